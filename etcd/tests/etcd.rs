//! The client against a real etcd, started by the harness on free ports.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

use std::time::Duration;

use rotary_etcd::testing::Etcd;
use rotary_etcd::{
    Client, ClientOptions, Compare, CompareOp, Error, EventKind, LeaseState, Op, OpResponse, Txn,
    WatchBatch, WatchOptions, Watcher,
};

fn start() -> Etcd {
    match Etcd::start() {
        Ok(etcd) => etcd,
        Err(e) => panic!("{e}"),
    }
}

async fn connect(etcd: &Etcd) -> Client {
    Client::connect(&[etcd.endpoint()], ClientOptions::default())
        .await
        .expect("connect to etcd")
}

/// Polls `check` every 100 ms until it holds or `bound` passes; returns
/// whether it held. The bound is generous: tests assert the outcome, not
/// how fast it came.
async fn eventually<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The next batch, riding over broken streams (retryable errors) for up to
/// 30 s of attempts.
async fn next_batch(watcher: &mut Watcher) -> WatchBatch {
    for _ in 0..300 {
        match tokio::time::timeout(Duration::from_secs(20), watcher.next()).await {
            Ok(Ok(batch)) => return batch,
            Ok(Err(e)) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(Err(e)) => panic!("watch failed: {e}"),
            Err(_) => panic!("no watch batch within 20 s"),
        }
    }
    panic!("the watch did not recover");
}

#[tokio::test]
async fn kv_round_trips() {
    let etcd = start();
    let client = Client::connect(
        &[etcd.endpoint()],
        ClientOptions {
            range_page_keys_max: 3,
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap();

    assert_eq!(client.get("/t/missing").await.unwrap().kv, None);

    let first = client.put("/t/a", "1", None).await.unwrap();
    let got = client.get("/t/a").await.unwrap();
    let kv = got.kv.expect("the key exists");
    assert_eq!(
        (kv.key.as_slice(), kv.value.as_slice()),
        (&b"/t/a"[..], &b"1"[..])
    );
    assert_eq!(kv.create_revision, first.revision);
    assert_eq!(kv.mod_revision, first.revision);
    assert_eq!(kv.version, 1);
    assert_eq!(got.revision, first.revision);

    let second = client.put("/t/a", vec![0u8, 255, 7], None).await.unwrap();
    assert_eq!(second.revision, first.revision + 1);
    let kv = client.get("/t/a").await.unwrap().kv.unwrap();
    assert_eq!(kv.value, vec![0u8, 255, 7]);
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first.revision, second.revision, 2)
    );

    // Ten keys under a prefix, read in pages of three, plus keys beside the
    // prefix that must not show up.
    for i in 0..10 {
        client
            .put(format!("/t/p/{i:02}"), format!("v{i}"), None)
            .await
            .unwrap();
    }
    client.put("/t/p0", "beside", None).await.unwrap();
    let last = client.put("/t/o", "before", None).await.unwrap();
    let range = client.range_prefix("/t/p/").await.unwrap();
    let keys: Vec<String> = range
        .kvs
        .iter()
        .map(|kv| String::from_utf8(kv.key.clone()).unwrap())
        .collect();
    let expected: Vec<String> = (0..10).map(|i| format!("/t/p/{i:02}")).collect();
    assert_eq!(keys, expected);
    assert_eq!(range.kvs[9].value, b"v9");
    assert_eq!(range.revision, last.revision);

    // Everything under /t/.
    assert_eq!(client.range_prefix("/t/").await.unwrap().kvs.len(), 13);

    let deleted = client.delete("/t/p/00").await.unwrap();
    assert_eq!(deleted.deleted, 1);
    assert_eq!(deleted.revision, last.revision + 1);
    assert_eq!(client.delete("/t/p/00").await.unwrap().deleted, 0);
    assert_eq!(client.delete_prefix("/t/p/").await.unwrap().deleted, 9);
    assert!(client.range_prefix("/t/p/").await.unwrap().kvs.is_empty());
    assert!(client.get("/t/p0").await.unwrap().kv.is_some());

    assert!(matches!(
        client.put("", "x", None).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        client.delete_prefix("").await,
        Err(Error::InvalidArgument { .. })
    ));
}

#[tokio::test]
async fn txn_compares_then_or_else() {
    let etcd = start();
    let client = connect(&etcd).await;

    let create = || {
        Txn::new()
            .when([Compare::absent("/t/item")])
            .and_then([
                Op::put("/t/item", "spec-1", None),
                Op::put("/t/other", "x", None),
            ])
            .or_else([Op::get("/t/item")])
    };
    let created = client.txn(create()).await.unwrap();
    assert!(created.succeeded);
    assert_eq!(created.responses, vec![OpResponse::Put, OpResponse::Put]);
    // Both puts share the transaction's one revision.
    let item = client.get("/t/item").await.unwrap().kv.unwrap();
    let other = client.get("/t/other").await.unwrap().kv.unwrap();
    assert_eq!(item.mod_revision, created.revision);
    assert_eq!(other.mod_revision, created.revision);

    // Creating again fails, and the else branch reads the current value.
    let again = client.txn(create()).await.unwrap();
    assert!(!again.succeeded);
    assert_eq!(again.revision, created.revision);
    match &again.responses[..] {
        [OpResponse::Range { kvs }] => assert_eq!(kvs[0].value, b"spec-1"),
        other => panic!("unexpected responses {other:?}"),
    }

    // A guarded update at the right mod revision succeeds; at a stale one fails.
    let update = |revision| {
        Txn::new()
            .when([Compare::unchanged_since("/t/item", revision)])
            .and_then([Op::put("/t/item", "spec-2", None)])
    };
    let updated = client.txn(update(created.revision)).await.unwrap();
    assert!(updated.succeeded);
    assert_eq!(updated.revision, created.revision + 1);
    let stale = client.txn(update(created.revision)).await.unwrap();
    assert!(!stale.succeeded);
    assert!(stale.responses.is_empty());
    assert_eq!(
        client.get("/t/item").await.unwrap().kv.unwrap().value,
        b"spec-2"
    );

    // Version, create revision and value comparisons.
    let checks = Txn::new().when([
        Compare::version("/t/item", CompareOp::Equal, 2),
        Compare::create_revision("/t/item", CompareOp::Equal, created.revision),
        Compare::value("/t/item", CompareOp::Equal, "spec-2"),
        Compare::value("/t/other", CompareOp::NotEqual, "y"),
        Compare::mod_revision("/t/item", CompareOp::Greater, created.revision),
        Compare::version("/t/missing", CompareOp::Less, 1),
    ]);
    assert!(client.txn(checks).await.unwrap().succeeded);
    let failing = Txn::new()
        .when([Compare::value("/t/item", CompareOp::Equal, "spec-1")])
        .or_else([Op::delete_prefix("/t/"), Op::get_prefix("/t/")]);
    let result = client.txn(failing).await.unwrap();
    assert!(!result.succeeded);
    assert_eq!(
        result.responses,
        vec![
            OpResponse::Delete { deleted: 2 },
            OpResponse::Range { kvs: Vec::new() }
        ]
    );

    // etcd refuses two writes to one key in one transaction.
    let twice = Txn::new().and_then([Op::put("/t/k", "1", None), Op::put("/t/k", "2", None)]);
    match client.txn(twice).await {
        Err(e @ Error::Status { .. }) => assert!(!e.is_retryable(), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn an_expired_lease_removes_its_keys() {
    let etcd = start();
    let client = connect(&etcd).await;
    let lease = client.lease_grant(Duration::from_secs(2)).await.unwrap();
    assert!(lease.ttl >= Duration::from_secs(2));
    client.put("/t/member", "me", Some(lease.id)).await.unwrap();
    let kv = client.get("/t/member").await.unwrap().kv.unwrap();
    assert_eq!(kv.lease, lease.id.0);
    assert!(client.lease_time_to_live(lease.id).await.unwrap().is_some());

    let gone = eventually(Duration::from_secs(30), || async {
        client.get("/t/member").await.unwrap().kv.is_none()
    })
    .await;
    assert!(gone, "the key outlived its lease");
    assert_eq!(client.lease_time_to_live(lease.id).await.unwrap(), None);
    match client.lease_keep_alive_once(lease.id).await {
        Err(Error::LeaseNotFound { lease_id }) => assert_eq!(lease_id, lease.id.0),
        other => panic!("expected LeaseNotFound, got {other:?}"),
    }
    assert!(matches!(
        client.lease_revoke(lease.id).await,
        Err(Error::LeaseNotFound { .. })
    ));
    // A put under a lease that is gone is refused.
    let refused = client.put("/t/member", "me", Some(lease.id)).await;
    assert!(matches!(refused, Err(Error::Status { .. })), "{refused:?}");
}

#[tokio::test]
async fn a_kept_lease_keeps_its_keys_until_revoked() {
    let etcd = start();
    let client = connect(&etcd).await;
    let lease = client.lease_grant(Duration::from_secs(2)).await.unwrap();
    client.put("/t/member", "me", Some(lease.id)).await.unwrap();
    let keeper = client.keep_lease_alive(lease);
    assert_eq!(keeper.id(), lease.id);

    // Three TTLs later the key is still there, and the keeper has renewed.
    tokio::time::sleep(lease.ttl * 3).await;
    assert!(client.get("/t/member").await.unwrap().kv.is_some());
    let valid_until = keeper.valid_until().expect("alive");
    assert!(valid_until > lease.granted_at + lease.ttl, "never renewed");
    let ttl = client.lease_keep_alive_once(lease.id).await.unwrap();
    assert!(ttl >= Duration::from_secs(1));

    keeper.revoke(&client).await.unwrap();
    assert!(client.get("/t/member").await.unwrap().kv.is_none());
}

#[tokio::test]
async fn a_keeper_reports_a_revoked_lease() {
    let etcd = start();
    let client = connect(&etcd).await;
    let lease = client.lease_grant(Duration::from_secs(3)).await.unwrap();
    let mut keeper = client.keep_lease_alive(lease);
    client.lease_revoke(lease.id).await.unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(30), keeper.lost())
        .await
        .expect("loss reported");
    assert!(
        matches!(lost, Error::LeaseNotFound { lease_id } if lease_id == lease.id.0),
        "{lost}"
    );
    assert_eq!(keeper.state(), LeaseState::NotFound);
    assert_eq!(keeper.valid_until(), None);
}

#[tokio::test]
async fn a_keeper_reports_expiry_when_etcd_stops_answering() {
    let mut etcd = start();
    let client = connect(&etcd).await;
    let lease = client.lease_grant(Duration::from_secs(2)).await.unwrap();
    let mut keeper = client.keep_lease_alive(lease);
    etcd.pause();
    let lost = tokio::time::timeout(Duration::from_secs(30), keeper.lost())
        .await
        .expect("loss reported");
    etcd.resume();
    assert!(matches!(lost, Error::LeaseExpired { .. }), "{lost}");
    assert!(!lost.is_retryable());
    assert_eq!(keeper.state(), LeaseState::Expired);
    etcd.stop();
}

#[tokio::test]
async fn watch_sees_puts_and_deletes_in_order() {
    let etcd = start();
    let client = connect(&etcd).await;
    client.put("/w/before", "x", None).await.unwrap();
    let mut watcher = client
        .watch_prefix(
            "/w/",
            WatchOptions {
                prev_kv: true,
                ..WatchOptions::default()
            },
        )
        .await
        .unwrap();

    let r1 = client.put("/w/a", "1", None).await.unwrap().revision;
    let r2 = client.put("/w/b", "2", None).await.unwrap().revision;
    client.put("/elsewhere", "-", None).await.unwrap();
    let r3 = client.delete("/w/a").await.unwrap().revision;
    let r4 = client
        .txn(Txn::new().and_then([Op::put("/w/c", "3", None), Op::delete("/w/b")]))
        .await
        .unwrap()
        .revision;

    let mut seen = Vec::new();
    while seen.last().map(|(_, _, rev, _)| *rev) != Some(r4) {
        let batch = next_batch(&mut watcher).await;
        for event in &batch.events {
            assert!(batch.revision >= event.kv.mod_revision);
            seen.push((
                event.kind,
                String::from_utf8(event.kv.key.clone()).unwrap(),
                event.kv.mod_revision,
                event.prev_kv.as_ref().map(|kv| kv.value.clone()),
            ));
        }
        assert_eq!(watcher.next_revision(), batch.revision + 1);
    }
    assert_eq!(
        seen,
        vec![
            (EventKind::Put, "/w/a".to_owned(), r1, None),
            (EventKind::Put, "/w/b".to_owned(), r2, None),
            (
                EventKind::Delete,
                "/w/a".to_owned(),
                r3,
                Some(b"1".to_vec())
            ),
            (EventKind::Put, "/w/c".to_owned(), r4, None),
            (
                EventKind::Delete,
                "/w/b".to_owned(),
                r4,
                Some(b"2".to_vec())
            ),
        ]
    );
}

#[tokio::test]
async fn watch_starts_from_a_past_revision() {
    let etcd = start();
    let client = connect(&etcd).await;
    let r1 = client.put("/w/k", "1", None).await.unwrap().revision;
    let r2 = client.put("/w/k", "2", None).await.unwrap().revision;
    let r3 = client.put("/w/k", "3", None).await.unwrap().revision;
    let mut watcher = client
        .watch_key(
            "/w/k",
            WatchOptions {
                start_revision: r2,
                ..WatchOptions::default()
            },
        )
        .await
        .unwrap();
    let mut values = Vec::new();
    while values.len() < 2 {
        let batch = next_batch(&mut watcher).await;
        values.extend(
            batch
                .events
                .iter()
                .map(|e| (e.kv.mod_revision, e.kv.value.clone())),
        );
    }
    assert_eq!(values, vec![(r2, b"2".to_vec()), (r3, b"3".to_vec())]);
    assert!(r1 < r2);
    assert_eq!(watcher.next_revision(), r3 + 1);
}

#[tokio::test]
async fn watch_resumes_after_etcd_restarts() {
    let mut etcd = start();
    let client = connect(&etcd).await;
    let mut watcher = client
        .watch_prefix("/w/", WatchOptions::default())
        .await
        .unwrap();
    let r1 = client.put("/w/one", "1", None).await.unwrap().revision;
    let batch = next_batch(&mut watcher).await;
    assert_eq!(batch.revision, r1);

    etcd.stop();
    let broken = tokio::time::timeout(Duration::from_secs(30), watcher.next())
        .await
        .expect("the broken stream is reported");
    match broken {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(batch) => panic!("a batch from a stopped etcd: {batch:?}"),
    }
    etcd.restart().unwrap();

    // The client reconnects by itself; the first write may meet the old
    // connection.
    let mut r2 = None;
    for _ in 0..50 {
        match client.put("/w/two", "2", None).await {
            Ok(put) => {
                r2 = Some(put.revision);
                break;
            }
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => panic!("{e}"),
        }
    }
    let r2 = r2.expect("etcd took writes again");
    let batch = next_batch(&mut watcher).await;
    // Exactly the new event: nothing lost, "/w/one" not delivered again.
    assert_eq!(batch.events.len(), 1);
    assert_eq!(batch.events[0].kv.key, b"/w/two");
    assert_eq!(batch.revision, r2);
}

#[tokio::test]
async fn watch_reports_compaction() {
    let etcd = start();
    let client = connect(&etcd).await;
    let r1 = client.put("/w/k", "1", None).await.unwrap().revision;
    client.put("/w/k", "2", None).await.unwrap();
    let r3 = client.put("/w/k", "3", None).await.unwrap().revision;
    client.compact(r3).await.unwrap();

    let error = match client
        .watch_prefix(
            "/w/",
            WatchOptions {
                start_revision: r1,
                ..WatchOptions::default()
            },
        )
        .await
    {
        Err(e) => e,
        Ok(mut watcher) => watcher
            .next()
            .await
            .expect_err("history before the compaction is gone"),
    };
    match &error {
        Error::Compacted {
            start_revision,
            compact_revision,
        } => assert_eq!((*start_revision, *compact_revision), (r1, r3)),
        other => panic!("expected Compacted, got {other}"),
    }
    assert!(!error.is_retryable());

    // From the compaction revision on, the watch works.
    let mut watcher = client
        .watch_prefix(
            "/w/",
            WatchOptions {
                start_revision: r3,
                ..WatchOptions::default()
            },
        )
        .await
        .unwrap();
    let batch = next_batch(&mut watcher).await;
    assert_eq!(batch.events[0].kv.value, b"3");
}

#[tokio::test]
async fn connect_skips_dead_endpoints() {
    let etcd = start();
    // A port nobody listens on: bind one and let it go.
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let client = Client::connect(&[dead.clone(), etcd.endpoint()], ClientOptions::default())
        .await
        .unwrap();
    client.put("/t/k", "v", None).await.unwrap();
    assert_eq!(client.get("/t/k").await.unwrap().kv.unwrap().value, b"v");

    match Client::connect(&[dead.as_str()], ClientOptions::default()).await {
        Err(e @ Error::Connect { .. }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains(&dead), "{e}");
        }
        other => panic!("expected Connect, got {:?}", other.err()),
    }
    assert!(matches!(
        Client::connect::<&str>(&[], ClientOptions::default()).await,
        Err(Error::NoEndpoints)
    ));
    assert!(matches!(
        Client::connect(&["127.0.0.1:2379"], ClientOptions::default()).await,
        Err(Error::InvalidEndpoint { .. })
    ));
}
