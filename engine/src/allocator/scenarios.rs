//! Gazette's allocator scenarios, and one test per rule of the plan.

use super::*;

/// Test fixture: a key space whose revisions advance like etcd's.
pub(super) struct Fixture {
    pub snap: Snapshot,
}

impl Fixture {
    pub fn new() -> Fixture {
        Fixture {
            snap: Snapshot::new("/root", 1),
        }
    }

    fn bump(&mut self) -> i64 {
        self.snap.revision += 1;
        self.snap.revision
    }

    pub fn member(&mut self, zone: &str, id: &str, limit: u32) -> &mut Fixture {
        let rev = self.bump();
        let key = MemberKey::new(zone, id).unwrap();
        self.snap.members.insert(
            key,
            Member {
                spec: MemberSpec {
                    endpoint: format!("{id}.test:7401"),
                    shards: 1,
                    journal_limit: limit,
                    exiting: false,
                },
                create_revision: rev,
                mod_revision: rev,
                lease: rev,
            },
        );
        self
    }

    pub fn update_member(&mut self, zone: &str, id: &str, f: impl FnOnce(&mut MemberSpec)) {
        let rev = self.bump();
        let m = self
            .snap
            .members
            .get_mut(&MemberKey::new(zone, id).unwrap())
            .unwrap();
        f(&mut m.spec);
        m.mod_revision = rev;
    }

    pub fn item(&mut self, journal: &str, replication: u32) -> &mut Fixture {
        let rev = self.bump();
        self.snap.items.insert(
            journal.to_string(),
            Item {
                replication,
                mod_revision: rev,
            },
        );
        self
    }

    /// An assignment `journal#zone#id#slot`, with an empty value.
    pub fn assign(&mut self, key: &str) -> &mut Fixture {
        let rev = self.bump();
        let Key::Assignment(k) = parse_key("/root", &format!("/root/assign/{key}")).unwrap() else {
            panic!("{key} is not an assignment");
        };
        self.snap.assignments.insert(
            k,
            Assignment {
                route: None,
                create_revision: rev,
                mod_revision: rev,
            },
        );
        self
    }

    /// What every primary does once it synchronized its route: writes the
    /// route into each assignment of its journal.
    pub fn mark_all_consistent(&mut self) {
        let rev = self.bump();
        let journals: Vec<String> = self
            .snap
            .assignments
            .keys()
            .map(|k| k.journal.clone())
            .collect();
        for j in journals {
            let keys: Vec<AssignmentKey> = self
                .snap
                .assignments_of(&j)
                .map(|(k, _)| k.clone())
                .collect();
            let route = Route::of(&keys);
            for k in keys {
                let a = self.snap.assignments.get_mut(&k).unwrap();
                if a.route.as_ref() != Some(&route) {
                    a.route = Some(route.clone());
                    a.mod_revision = rev;
                }
            }
        }
    }

    /// Plans and applies until a plan is empty; the number of plans applied.
    pub fn serve_until_idle(&mut self) -> usize {
        for round in 0..100 {
            let changes = plan(&self.snap);
            if changes.is_empty() {
                return round;
            }
            check_plan(&self.snap, &changes);
            self.snap.apply_txn(&changes).expect("a fresh plan applies");
        }
        panic!("no convergence in 100 rounds: {:?}", plan(&self.snap));
    }

    pub fn keys(&self) -> Vec<String> {
        self.snap
            .assignments
            .keys()
            .map(|k| k.to_string())
            .collect()
    }
}

/// What holds of every plan, whatever the snapshot.
pub(super) fn check_plan(snap: &Snapshot, changes: &[Change]) {
    let next = apply(snap, changes).expect("a plan applies to its own snapshot");
    for (j, item) in &snap.items {
        let before: Vec<_> = snap.assignments_of(j).collect();
        let after: Vec<_> = next.assignments_of(j).collect();
        let primaries = after.iter().filter(|(k, _)| k.slot == 0).count();
        assert!(primaries <= 1, "{j} has {primaries} primaries");
        let keys: Vec<&AssignmentKey> = before.iter().map(|(k, _)| *k).collect();
        let consistent_before = before
            .iter()
            .filter(|(_, a)| consistent(a, keys.iter().copied()))
            .count() as u32;
        // Copies that held the journal's bytes before and still do.
        let kept = before
            .iter()
            .filter(|(k, a)| {
                consistent(a, keys.iter().copied())
                    && after.iter().any(|(k2, _)| k2.member == k.member)
            })
            .count() as u32;
        assert!(
            kept >= consistent_before.min(item.replication),
            "{j}: {consistent_before} consistent copies before, {kept} after"
        );
    }
    for (m, mem) in &snap.members {
        let before = snap.assignments.keys().filter(|k| &k.member == m).count();
        let after = next.assignments.keys().filter(|k| &k.member == m).count();
        assert!(
            after <= before.max(mem.spec.journal_limit as usize),
            "{m} holds {after} journals, limit {}",
            mem.spec.journal_limit
        );
        if mem.spec.capacity() == 0 {
            assert!(after <= before, "{m} takes no journals but was given some");
        }
    }
}

fn three_items(f: &mut Fixture) {
    f.item("item-1", 1).item("item-2", 2).item("item-3", 3);
}

#[test]
fn initial_allocation_is_gazettes() {
    let mut f = Fixture::new();
    three_items(&mut f);
    f.member("zone-a", "A1", 2)
        .member("zone-a", "A2", 2)
        .member("zone-b", "B", 4);
    assert_eq!(f.serve_until_idle(), 1);
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A1#0",
            "item-2#zone-a#A2#0",
            "item-2#zone-b#B#1",
            "item-3#zone-a#A1#0",
            "item-3#zone-a#A2#1",
            "item-3#zone-b#B#2",
        ]
    );
    // The primaries synchronize; nothing more to do.
    f.mark_all_consistent();
    assert!(plan(&f.snap).is_empty());
}

#[test]
fn initial_allocation_spreads_every_item_over_both_zones() {
    let mut f = Fixture::new();
    for i in 1..=7 {
        f.item(&format!("item-{i:02}"), 3);
    }
    f.member("zone-a", "A1", 1024)
        .member("zone-a", "A2", 1024)
        .member("zone-b", "B1", 1024);
    assert_eq!(f.serve_until_idle(), 1);
    let want: Vec<String> = (1..=7)
        .flat_map(|i| {
            [
                format!("item-{i:02}#zone-a#A1#0"),
                format!("item-{i:02}#zone-a#A2#1"),
                format!("item-{i:02}#zone-b#B1#2"),
            ]
        })
        .collect();
    assert_eq!(f.keys(), want);
}

fn replace_fixture(f: &mut Fixture) {
    three_items(f);
    f.member("zone-a", "A", 2)
        .member("zone-b", "B", 4)
        .member("zone-a", "old", 0)
        .member("zone-a", "new", 3);
}

/// A member at limit 0 keeps its assignments until their replacements are
/// consistent.
#[test]
fn a_member_at_limit_zero_is_replaced_before_it_is_removed() {
    let mut f = Fixture::new();
    replace_fixture(&mut f);
    for k in [
        "item-1#zone-a#A#0",
        "item-2#zone-a#old#0",
        "item-2#zone-b#B#1",
        "item-3#zone-a#A#0",
        "item-3#zone-a#old#1",
        "item-3#zone-b#B#2",
    ] {
        f.assign(k);
    }
    // Nothing is consistent: replacements may be added, nothing removed.
    assert_eq!(f.serve_until_idle(), 1);
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A#0",
            "item-2#zone-a#new#2",
            "item-2#zone-a#old#0",
            "item-2#zone-b#B#1",
            "item-3#zone-a#A#0",
            "item-3#zone-a#new#3",
            "item-3#zone-a#old#1",
            "item-3#zone-b#B#2",
        ]
    );
    // However often it runs, `old` stays while `new` is not consistent.
    assert!(plan(&f.snap).is_empty());

    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 3);
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A#0",
            "item-2#zone-a#new#1",
            "item-2#zone-b#B#0",
            "item-3#zone-a#A#0",
            "item-3#zone-a#new#2",
            "item-3#zone-b#B#1",
        ]
    );
}

#[test]
fn a_consistent_member_at_limit_zero_hands_off_its_primaries() {
    let mut f = Fixture::new();
    replace_fixture(&mut f);
    for k in [
        "item-1#zone-a#A#0",
        "item-2#zone-a#old#0",
        "item-2#zone-b#B#1",
        "item-3#zone-a#old#0",
        "item-3#zone-a#A#1",
        "item-3#zone-b#B#2",
    ] {
        f.assign(k);
    }
    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 1);
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A#0",
            "item-2#zone-a#new#2",
            "item-2#zone-a#old#0",
            "item-2#zone-b#B#1",
            "item-3#zone-a#A#1",
            "item-3#zone-a#new#3",
            "item-3#zone-a#old#0",
            "item-3#zone-b#B#2",
        ]
    );
    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 2);
    // `new` became item-3's primary: each member has one primary.
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A#0",
            "item-2#zone-a#new#1",
            "item-2#zone-b#B#0",
            "item-3#zone-a#A#1",
            "item-3#zone-a#new#0",
            "item-3#zone-b#B#2",
        ]
    );
}

#[test]
fn changed_replication_adds_before_it_removes() {
    let mut f = Fixture::new();
    three_items(&mut f);
    f.member("zone-a", "A1", 2)
        .member("zone-a", "A2", 2)
        .member("zone-b", "B", 4);
    for k in [
        "item-1#zone-b#B#0",
        "item-2#zone-a#A1#0",
        "item-2#zone-b#B#1",
        "item-3#zone-a#A1#0",
        "item-3#zone-a#A2#1",
        "item-3#zone-b#B#2",
    ] {
        f.assign(k);
    }
    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 0, "the allocation is stable");
    f.item("item-1", 3).item("item-3", 1);
    assert_eq!(f.serve_until_idle(), 4);
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A1#2",
            "item-1#zone-a#A2#1",
            "item-1#zone-b#B#0",
            "item-2#zone-a#A1#0",
            "item-2#zone-b#B#1",
            "item-3#zone-a#A2#0",
        ]
    );
    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 0);
}

#[test]
fn an_idle_cluster_writes_nothing() {
    let mut f = Fixture::new();
    for i in 0..50 {
        f.item(&format!("j/{i:03}"), 1 + i % 3);
    }
    f.member("a", "1", 40)
        .member("a", "2", 40)
        .member("b", "3", 40)
        .member("c", "4", 40);
    f.serve_until_idle();
    f.mark_all_consistent();
    f.serve_until_idle();
    f.mark_all_consistent();
    assert!(plan(&f.snap).is_empty());
    assert_eq!(
        f.snap.assignments.len(),
        (0..50).map(|i| 1 + i % 3).sum::<u32>() as usize
    );
}

/// The primary's lease expired: its member key and assignments are gone.
/// A replica that held the synchronized route is promoted at once, even
/// before anything else is consistent, and not a fresh replica.
#[test]
fn a_journal_without_primary_gets_one_at_once() {
    let mut f = Fixture::new();
    f.item("j/one", 2);
    f.member("a", "P", 10)
        .member("b", "R", 10)
        .member("c", "S", 10);
    f.assign("j/one#a#P#0").assign("j/one#b#R#1");
    f.mark_all_consistent();
    assert!(plan(&f.snap).is_empty());
    // A fresh replica, never synchronized, at a lower slot than R.
    f.snap
        .assignments
        .remove(&AssignmentKey::new("j/one", MemberKey::new("b", "R").unwrap(), 1).unwrap());
    f.assign("j/one#b#R#3").assign("j/one#c#S#1");
    f.mark_all_consistent();
    // Now only R is synchronized; S is fresh.
    let s_key = AssignmentKey::new("j/one", MemberKey::new("c", "S").unwrap(), 1).unwrap();
    f.snap.assignments.get_mut(&s_key).unwrap().route = None;
    // P dies.
    f.snap.members.remove(&MemberKey::new("a", "P").unwrap());
    f.snap
        .assignments
        .remove(&AssignmentKey::new("j/one", MemberKey::new("a", "P").unwrap(), 0).unwrap());
    f.snap.revision += 1;
    let changes = plan(&f.snap);
    check_plan(&f.snap, &changes);
    let promoted: Vec<_> = changes
        .iter()
        .filter_map(|c| match c {
            Change::Reslot {
                from, to_slot: 0, ..
            } => Some(from.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(promoted, ["j/one#b#R#3"]);
}

#[test]
fn members_stay_within_their_limits() {
    let mut f = Fixture::new();
    for i in 0..20 {
        f.item(&format!("j/{i:02}"), 2);
    }
    f.member("a", "1", 5)
        .member("a", "2", 7)
        .member("b", "3", 11);
    f.serve_until_idle();
    f.mark_all_consistent();
    f.serve_until_idle();
    let count = |id: &str| {
        f.snap
            .assignments
            .keys()
            .filter(|k| k.member.id == id)
            .count()
    };
    assert_eq!((count("1"), count("2"), count("3")), (5, 7, 11));
    // 23 copies fit, of 40 wanted: every journal has one before any has two.
    for i in 0..20 {
        let n = f.snap.assignments_of(&format!("j/{i:02}")).count();
        assert!((1..=2).contains(&n), "j/{i:02} has {n} copies");
    }
}

#[test]
fn replicas_go_to_distinct_zones() {
    let mut f = Fixture::new();
    for i in 0..40 {
        f.item(&format!("j/{i:02}"), 3);
    }
    f.member("a", "1", 100)
        .member("a", "2", 100)
        .member("a", "3", 100)
        .member("b", "4", 100)
        .member("c", "5", 100);
    f.serve_until_idle();
    for i in 0..40 {
        let mut zones: Vec<String> = f
            .snap
            .assignments_of(&format!("j/{i:02}"))
            .map(|(k, _)| k.member.zone.clone())
            .collect();
        zones.sort();
        assert_eq!(zones, ["a", "b", "c"], "j/{i:02}");
    }
}

#[test]
fn load_is_balanced_and_a_new_member_takes_its_share() {
    let mut f = Fixture::new();
    for i in 0..100 {
        f.item(&format!("j/{i:03}"), 3);
    }
    f.member("", "1", 1000)
        .member("", "2", 1000)
        .member("", "3", 1000);
    f.serve_until_idle();
    f.mark_all_consistent();
    let count = |f: &Fixture, id: &str| {
        f.snap
            .assignments
            .keys()
            .filter(|k| k.member.id == id)
            .count()
    };
    assert_eq!(
        [count(&f, "1"), count(&f, "2"), count(&f, "3")],
        [100, 100, 100]
    );

    f.member("", "4", 1000);
    for _ in 0..20 {
        f.serve_until_idle();
        f.mark_all_consistent();
    }
    assert!(plan(&f.snap).is_empty());
    assert_eq!(
        [
            count(&f, "1"),
            count(&f, "2"),
            count(&f, "3"),
            count(&f, "4")
        ],
        [75, 75, 75, 75]
    );
    // Fewest moves: 75 copies moved to the new member, none elsewhere.
    let primaries = f.snap.assignments.keys().filter(|k| k.slot == 0).count();
    assert_eq!(primaries, 100);
}

#[test]
fn an_exiting_member_is_drained_add_first() {
    let mut f = Fixture::new();
    for i in 0..10 {
        f.item(&format!("j/{i}"), 2);
    }
    f.member("a", "1", 10)
        .member("b", "2", 10)
        .member("c", "3", 10);
    f.serve_until_idle();
    f.mark_all_consistent();
    f.update_member("a", "1", |s| s.exiting = true);
    let held = |f: &Fixture| {
        f.snap
            .assignments
            .keys()
            .filter(|k| k.member.id == "1")
            .count()
    };
    let before = held(&f);
    assert!(before > 0);
    f.serve_until_idle();
    assert_eq!(
        held(&f),
        before,
        "nothing goes before its replacement is consistent"
    );
    for _ in 0..10 {
        f.mark_all_consistent();
        f.serve_until_idle();
    }
    assert_eq!(held(&f), 0);
    for i in 0..10 {
        assert_eq!(f.snap.assignments_of(&format!("j/{i}")).count(), 2);
    }
}

#[test]
fn a_deleted_journals_assignments_go_while_it_stays_deleted() {
    let mut f = Fixture::new();
    f.item("j/a", 1).member("a", "1", 5);
    f.serve_until_idle();
    f.snap.items.remove("j/a");
    let changes = plan(&f.snap);
    assert_eq!(changes.len(), 1);
    assert!(matches!(
        &changes[0],
        Change::Remove {
            item_mod_revision: 0,
            ..
        }
    ));
    // Re-created meanwhile: the removal fails.
    let mut again = f.snap.clone();
    again.items.insert(
        "j/a".into(),
        Item {
            replication: 1,
            mod_revision: 99,
        },
    );
    assert!(again.apply_txn(&changes).is_err());
    f.snap.apply_txn(&changes).unwrap();
    assert!(f.snap.assignments.is_empty());
}

/// A removal counted on the journal's other copies: if one of them vanishes
/// (its broker's lease expired) before the plan lands, the removal fails.
#[test]
fn a_stale_plan_fails_whole() {
    let mut f = Fixture::new();
    f.item("j/a", 2)
        .member("a", "1", 5)
        .member("a", "2", 5)
        .member("a", "3", 5);
    f.assign("j/a#a#1#0")
        .assign("j/a#a#2#1")
        .assign("j/a#a#3#2");
    f.mark_all_consistent();
    let changes = plan(&f.snap);
    assert!(changes.iter().any(|c| matches!(c, Change::Remove { .. })));
    let mut stale = f.snap.clone();
    let survivor = changes
        .iter()
        .find_map(|c| match c {
            Change::Remove { keep, .. } => keep.iter().find(|(k, _)| k.slot != 0).cloned(),
            _ => None,
        })
        .unwrap();
    stale.assignments.remove(&survivor.0);
    let e = stale.apply_txn(&changes).unwrap_err();
    assert_eq!(e.found, 0);
    assert!(e.key.starts_with("/root/assign/j/a#"), "{e}");
}

#[test]
fn transactions_keep_a_journals_changes_together() {
    let mut f = Fixture::new();
    for i in 0..100 {
        f.item(&format!("j/{i:03}"), 3);
    }
    f.member("a", "1", 1000)
        .member("b", "2", 1000)
        .member("c", "3", 1000);
    let changes = plan(&f.snap);
    assert_eq!(changes.len(), 300);
    let txns = transactions(&changes, TXN_OPS_MAX);
    assert_eq!(txns.iter().map(|t| t.len()).sum::<usize>(), 300);
    for t in &txns {
        let cmps: usize = t.iter().map(|c| c.guards().len()).sum();
        let ops: usize = t.iter().map(|c| c.ops("/root").len()).sum();
        assert!(cmps <= TXN_OPS_MAX && ops <= TXN_OPS_MAX, "{cmps} {ops}");
    }
    for w in txns.windows(2) {
        assert_ne!(w[0].last().unwrap().journal(), w[1][0].journal());
    }
    let mut snap = f.snap.clone();
    for t in txns {
        snap.apply_txn(t).unwrap();
    }
    let one = apply(&f.snap, &changes).unwrap();
    assert!(snap.assignments.keys().eq(one.assignments.keys()));
}

#[test]
fn the_leader_is_the_oldest_member() {
    let mut f = Fixture::new();
    assert_eq!(f.snap.leader(), None);
    f.member("b", "first", 1).member("a", "second", 1);
    assert_eq!(f.snap.leader().unwrap().id, "first");
    f.snap
        .members
        .remove(&MemberKey::new("b", "first").unwrap());
    assert_eq!(f.snap.leader().unwrap().id, "second");
}

#[test]
fn routes_round_trip_and_define_consistency() {
    let k = |s: &str| match parse_key("/r", &format!("/r/assign/{s}")).unwrap() {
        Key::Assignment(a) => a,
        _ => unreachable!(),
    };
    let cur = [k("j#a#1#0"), k("j#b#2#1")];
    let route = Route::of(&cur);
    assert_eq!(
        String::from_utf8(route.encode()).unwrap(),
        r#"{"primary":"a#1","members":["a#1","b#2"]}"#
    );
    assert_eq!(Route::decode(&route.encode()).unwrap(), Some(route.clone()));
    assert_eq!(Route::decode(b"").unwrap(), None);
    assert!(Route::decode(b"{nope")
        .unwrap_err()
        .to_string()
        .contains("{nope"));
    let synced = Assignment {
        route: Some(route.clone()),
        ..Assignment::default()
    };
    assert!(consistent(&synced, &cur));
    // Another replica joins: the route changed, nobody is consistent.
    let grown = [k("j#a#1#0"), k("j#b#2#1"), k("j#c#3#2")];
    assert!(!consistent(&synced, &grown));
    // The primary changed: not consistent either.
    assert!(!consistent(&synced, &[k("j#a#1#1"), k("j#b#2#0")]));
    // Packing a replica slot keeps the route.
    assert!(consistent(&synced, &[k("j#a#1#0"), k("j#b#2#5")]));
    assert!(!consistent(&Assignment::default(), &cur));
}

#[test]
fn a_snapshot_follows_etcds_key_values() {
    let mut s = Snapshot::new("/rotary/", 10);
    let spec = br#"{"endpoint":"10.0.0.1:7401","shards":4,"journal_limit":100}"#;
    let m = s
        .put_member("/rotary/members/zone-a#b1", spec, 5, 7, 42)
        .unwrap();
    assert_eq!(s.members[&m].spec.journal_limit, 100);
    assert!(!s.members[&m].spec.exiting);
    assert_eq!(s.members[&m].lease, 42);
    assert_eq!(
        s.leader_guard(),
        Some(Guard {
            key: GuardKey::Member(m.clone()),
            mod_revision: 7
        })
    );
    let route = Route {
        primary: Some(m.clone()),
        members: vec![m.clone()],
    };
    let a = s
        .put_assignment("/rotary/assign/a/b#zone-a#b1#0", &route.encode(), 8, 9)
        .unwrap();
    assert_eq!(s.assignments[&a].route, Some(route));
    // A value that does not decode: kept, never consistent, reported.
    let e = s
        .put_assignment("/rotary/assign/c/d#zone-a#b1#0", b"garbage", 8, 9)
        .unwrap_err();
    assert!(matches!(e, KvError::Route(_)), "{e}");
    assert_eq!(s.assignments.len(), 2);
    assert!(s
        .put_member("/rotary/members/zone-a#b2", b"{}", 1, 1, 1)
        .is_err());
    assert!(matches!(
        s.put_member("/rotary/items/x", spec, 1, 1, 1),
        Err(KvError::WrongKind { .. })
    ));
    assert!(s
        .put_assignment("/elsewhere/assign/a#b#c#0", b"", 1, 1)
        .is_err());
    s.delete("/rotary/assign/c/d#zone-a#b1#0").unwrap();
    s.delete("/rotary/members/zone-a#b1").unwrap();
    assert_eq!(s.assignments.len(), 1);
    assert!(s.members.is_empty());
    assert_eq!(s.leader_guard(), None);
}

/// Gazette's scenario of a member whose limit is raised, then lowered
/// twice: the same allocations come out.
#[test]
fn raising_and_lowering_a_limit_moves_journals_add_first() {
    let mut f = Fixture::new();
    three_items(&mut f);
    f.member("zone-a", "A", 2)
        .member("zone-a", "limit", 2)
        .member("zone-b", "B", 4);
    for k in [
        "item-1#zone-b#B#0",
        "item-2#zone-a#A#0",
        "item-2#zone-b#B#1",
        "item-3#zone-a#A#0",
        "item-3#zone-a#limit#1",
        "item-3#zone-b#B#2",
    ] {
        f.assign(k);
    }
    f.mark_all_consistent();
    assert_eq!(f.serve_until_idle(), 0);
    let want: [[&str; 6]; 3] = [
        [
            "item-1#zone-a#limit#0",
            "item-2#zone-a#limit#1",
            "item-2#zone-b#B#0",
            "item-3#zone-a#A#0",
            "item-3#zone-a#limit#1",
            "item-3#zone-b#B#2",
        ],
        [
            "item-1#zone-a#limit#0",
            "item-2#zone-a#A#1",
            "item-2#zone-b#B#0",
            "item-3#zone-a#A#0",
            "item-3#zone-a#limit#1",
            "item-3#zone-b#B#2",
        ],
        [
            "item-1#zone-b#B#0",
            "item-2#zone-a#A#1",
            "item-2#zone-b#B#0",
            "item-3#zone-a#A#0",
            "item-3#zone-a#limit#1",
            "item-3#zone-b#B#2",
        ],
    ];
    for (limit, want) in [10, 2, 1].into_iter().zip(want) {
        f.update_member("zone-a", "limit", |s| s.journal_limit = limit);
        // Additions first; removals wait for the primaries to synchronize.
        assert!(f.serve_until_idle() >= 1);
        assert_ne!(f.keys(), want, "limit {limit}: removed before synchronized");
        for _ in 0..5 {
            f.mark_all_consistent();
            f.serve_until_idle();
        }
        assert!(plan(&f.snap).is_empty());
        assert_eq!(f.keys(), want, "limit {limit}");
    }
}

/// Too few member slots for every copy: every journal gets a copy before
/// any gets a second. (Gazette's maximum flow would also move item-1 off
/// A1 once A3 joins so that item-3 gets its third copy there; this greedy
/// plan leaves that copy unplaced, see the module's notes.)
#[test]
fn scaling_up_from_too_few_members() {
    let mut f = Fixture::new();
    three_items(&mut f);
    f.member("zone-a", "A1", 1);
    assert_eq!(f.serve_until_idle(), 1);
    assert_eq!(f.keys(), ["item-1#zone-a#A1#0"]);
    f.member("zone-a", "A2", 2);
    for _ in 0..5 {
        f.serve_until_idle();
        f.mark_all_consistent();
    }
    assert_eq!(
        f.keys(),
        [
            "item-1#zone-a#A1#0",
            "item-2#zone-a#A2#0",
            "item-3#zone-a#A2#0"
        ]
    );
    f.member("zone-a", "A3", 3);
    for _ in 0..5 {
        f.serve_until_idle();
        f.mark_all_consistent();
    }
    assert!(plan(&f.snap).is_empty());
    for (j, min) in [("item-1", 1), ("item-2", 2), ("item-3", 2)] {
        assert!(f.snap.assignments_of(j).count() >= min, "{j}");
    }
}
