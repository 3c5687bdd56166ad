//! Consumer processes' sessions on a real etcd: shards placed by the
//! allocator (a primary and standbys in other zones), a ready standby
//! promoted when its primary's process goes, one member key per process.

#![allow(clippy::disallowed_methods)] // Tests time a real etcd.

use rotary_consumer::cluster::{apply_shards, ConsumerConfig, Session, SessionError};
use rotary_consumer::spec::ShardSpec;
use rotary_etcd::keyspace::Etcd;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const PREFIX: &str = "/word-count";

fn config(etcd: &rotary_etcd::testing::Etcd, zone: &str, id: &str) -> ConsumerConfig {
    ConsumerConfig {
        endpoints: vec![etcd.endpoint()],
        prefix: PREFIX.into(),
        zone: zone.into(),
        id: id.into(),
        endpoint: format!("127.0.0.1:{}", 9000 + id.len()),
        shard_limit: 8,
        lease_ttl: Duration::from_secs(3),
    }
}

fn shard(id: &str, hot_standbys: u32, disable: bool) -> (ShardSpec, Option<i64>) {
    let mut s = ShardSpec::new(id);
    s.hot_standbys = hot_standbys;
    s.disable = disable;
    (s, Some(0))
}

/// Every process steps, marks what it holds ready (as a recovered primary
/// or a tailing standby would) and renews its lease, until `done` holds
/// of the processes' assignments, for at most 20 s.
async fn settle(
    sessions: &mut [Session],
    done: impl Fn(&[BTreeMap<String, (u32, bool)>]) -> bool,
) -> Vec<BTreeMap<String, (u32, bool)>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for s in sessions.iter_mut() {
            s.step(Duration::from_millis(50)).await.expect("step");
            for shard in s.assigned().keys() {
                s.mark_ready(shard).await.expect("mark ready");
            }
            s.keep_alive().await.expect("keep alive");
        }
        let assigned: Vec<_> = sessions.iter().map(Session::assigned).collect();
        if done(&assigned) {
            return assigned;
        }
        assert!(
            Instant::now() < deadline,
            "no settled placement: {assigned:?}"
        );
    }
}

fn all_ready_with(
    assigned: &[BTreeMap<String, (u32, bool)>],
    shards: &[&str],
    copies: usize,
) -> bool {
    shards.iter().all(|id| {
        let held: Vec<&(u32, bool)> = assigned.iter().filter_map(|a| a.get(*id)).collect();
        held.len() == copies && held.iter().all(|(_, ready)| *ready)
    })
}

#[tokio::test(flavor = "current_thread")]
async fn shards_get_a_primary_and_a_standby_in_another_zone_and_fail_over() {
    let etcd = rotary_etcd::testing::Etcd::start().expect("etcd");
    let a = Session::open(config(&etcd, "zone-a", "c1")).await.unwrap();
    let b = Session::open(config(&etcd, "zone-b", "c2")).await.unwrap();
    let client = Etcd::connect(&[etcd.endpoint()]).await.unwrap();
    let specs = [
        shard("shard-000", 1, false),
        shard("shard-001", 1, false),
        shard("shard-002", 1, false),
        shard("shard-off", 1, true),
    ];
    assert!(apply_shards(&client, PREFIX, &specs)
        .await
        .unwrap()
        .is_some());
    let ids = ["shard-000", "shard-001", "shard-002"];
    let mut sessions = vec![a, b];
    let placed = settle(&mut sessions, |a| all_ready_with(a, &ids, 2)).await;
    for id in ids {
        // One copy per zone, one of them the primary.
        let slots: Vec<u32> = placed.iter().map(|a| a[id].0).collect();
        assert!(
            slots.contains(&0) && slots.iter().filter(|s| **s == 0).count() == 1,
            "{id}: {slots:?}"
        );
    }
    assert!(
        placed.iter().all(|a| !a.contains_key("shard-off")),
        "a disabled shard is placed nowhere"
    );

    // The first process goes (its lease is revoked): the ready standbys in
    // the other zone are promoted, and nothing is left on the one gone.
    let gone = sessions.remove(0);
    gone.close().await;
    let after = settle(&mut sessions, |a| {
        ids.iter().all(|id| a[0].get(*id) == Some(&(0, true)))
    })
    .await;
    assert_eq!(after[0].len(), 3, "{after:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_second_process_with_the_same_identity_is_refused() {
    let etcd = rotary_etcd::testing::Etcd::start().expect("etcd");
    let first = Session::open(config(&etcd, "zone-a", "c1")).await.unwrap();
    let second = Session::open(config(&etcd, "zone-a", "c1")).await;
    assert!(
        matches!(second, Err(SessionError::MemberTaken(ref k)) if k == "/word-count/members/zone-a#c1"),
        "{:?}",
        second.err()
    );
    let bad = Session::open(config(&etcd, "zone#a", "c2")).await;
    assert!(
        matches!(bad, Err(SessionError::Member { .. })),
        "{:?}",
        bad.err()
    );
    first.close().await;
    // Once the first is gone, the identity is free again.
    Session::open(config(&etcd, "zone-a", "c1"))
        .await
        .unwrap()
        .close()
        .await;
}

#[tokio::test(flavor = "current_thread")]
async fn shard_specs_apply_only_at_the_revisions_they_were_read_at() {
    let etcd = rotary_etcd::testing::Etcd::start().expect("etcd");
    let client = Etcd::connect(&[etcd.endpoint()]).await.unwrap();
    let created = apply_shards(&client, PREFIX, &[shard("shard-000", 0, false)])
        .await
        .unwrap();
    let revision = created.expect("applied");
    // Creating it again (revision 0: must not exist) changes nothing.
    assert_eq!(
        apply_shards(&client, PREFIX, &[shard("shard-000", 2, false)])
            .await
            .unwrap(),
        None
    );
    let mut edited = ShardSpec::new("shard-000");
    edited.hot_standbys = 2;
    let applied = apply_shards(&client, PREFIX, &[(edited.clone(), Some(revision))])
        .await
        .unwrap();
    assert!(applied.is_some());
    // The same edit from the old revision is now stale.
    assert_eq!(
        apply_shards(&client, PREFIX, &[(edited, Some(revision))])
            .await
            .unwrap(),
        None
    );
    let s = Session::open(config(&etcd, "zone-a", "c1")).await.unwrap();
    assert_eq!(s.keyspace.shards["shard-000"].hot_standbys, 2);
    assert_eq!(s.keyspace.snapshot.items["shard-000"].replication, 3);
    s.close().await;
}
