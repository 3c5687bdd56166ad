//! A cluster on etcd, end to end: a real `etcd` and real `rotary serve
//! --etcd` processes on loopback. Journals are assigned by the allocator,
//! move when a broker dies or leaves, and never lose an acknowledged byte.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::etcd_cluster::EtcdCluster;
use common::{parse_records, read_range, record, run_cli, sha1, status_of, Found};
use rotary_net::client::Client;
use rotary_net::wire::AppendRequest;
use rotary_net::Status;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The lease TTL of the brokers of these tests.
const TTL: &str = "3s";
/// How long writers keep trying an append while its journal fails over.
const WRITER_RETRY: Duration = Duration::from_secs(30);

/// Applies `specs` through the CLI, as YAML; returns the exit code and stderr.
fn apply_yaml(c: &EtcdCluster, yaml: &str) -> (i32, String) {
    let (code, _, err) = run_cli(c.cli(&["journals", "apply", "-f", "-"]), yaml.as_bytes());
    (code, err)
}

/// When each acknowledged append was sent, and when its ack came.
type Times = Arc<Mutex<Vec<(Instant, Instant)>>>;

/// What each writer had acknowledged: (writer, seq) → offsets.
type Acked = Arc<Mutex<BTreeMap<(u32, u32), (u64, u64)>>>;

/// Writers appending records to `journal` one after another, each waiting
/// for its ack, until `stop`; returns the tasks. Each ack is recorded with
/// the time it came (for the time to the first ack after a fault).
fn start_writers(
    client: &Client,
    journal: &str,
    writers: u32,
    acked: &Acked,
    ack_times: &Times,
    failures: &Arc<Mutex<Vec<String>>>,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..writers)
        .map(|w| {
            let (client, journal) = (client.clone(), journal.to_string());
            let (acked, times, failures, stop) = (
                acked.clone(),
                ack_times.clone(),
                failures.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut seq = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = AppendRequest {
                        journal: journal.clone(),
                        ..AppendRequest::default()
                    };
                    let len = 64 + (seq as usize * 37) % 900;
                    let sent = Instant::now();
                    match client.append(&req, record(w, seq, len)).await {
                        Ok(r) => {
                            acked.lock().unwrap().insert((w, seq), (r.begin, r.end));
                            times.lock().unwrap().push((sent, Instant::now()));
                        }
                        Err(e) => failures
                            .lock()
                            .unwrap()
                            .push(format!("writer {w} seq {seq}: {e}")),
                    }
                    seq += 1;
                }
            })
        })
        .collect()
}

/// Reads `[from, to)` of `journal` from broker `endpoint`'s own copy.
async fn pinned_copy(endpoint: &str, journal: &str, from: u64, to: u64) -> Vec<u8> {
    let client = Client::connect_pinned(endpoint)
        .await
        .expect("connect pinned");
    let (bytes, done) = read_range(&client, journal, from, Some(to))
        .await
        .unwrap_or_else(|e| panic!("pinned read of {journal} at {endpoint}: {e}"));
    assert_eq!(done.status, Status::OK, "{endpoint}: {done:?}");
    bytes
}

/// Checks that every acknowledged record is in `bytes` (the journal from
/// offset 0) at the offsets its ack gave, once.
fn check_acked(bytes: &[u8], acked: &BTreeMap<(u32, u32), (u64, u64)>) {
    let found: Vec<Found> = parse_records(bytes, 0).unwrap_or_else(|e| panic!("{e}"));
    let at: BTreeMap<(u32, u32), Vec<(u64, u64)>> =
        found.iter().fold(BTreeMap::new(), |mut m, f| {
            m.entry((f.writer, f.seq))
                .or_default()
                .push((f.begin, f.end));
            m
        });
    for (key, offsets) in acked {
        let places = at.get(key).map(Vec::as_slice).unwrap_or_default();
        assert!(
            places.contains(offsets),
            "acknowledged record {key:?} at {offsets:?} is not in the journal (found at {places:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journals_are_assigned_across_zones_and_replicated() {
    let c = EtcdCluster::start(4, 1, TTL);
    let (code, err) = apply_yaml(&c, "- {name: etcd/assigned, replication: 3}\n");
    assert_eq!(code, 0, "{err}");
    let info = c.assigned("etcd/assigned", 3).await;
    let mut members = info.route.members.clone();
    members.sort();
    members.dedup();
    assert_eq!(members.len(), 3, "three distinct brokers: {info:?}");

    let client = c.client(WRITER_RETRY).await;
    let mut expect = Vec::new();
    for seq in 0..50 {
        let r = record(1, seq, 100 + seq as usize);
        let req = AppendRequest {
            journal: "etcd/assigned".into(),
            ..AppendRequest::default()
        };
        let reply = client.append(&req, r.clone()).await.expect("append");
        assert_eq!(reply.begin, expect.len() as u64);
        expect.extend_from_slice(&r);
    }
    // Every member holds the same bytes.
    for id in &info.route.members {
        let b = &c.brokers[c.index(id)];
        let copy = pinned_copy(&b.endpoint(), "etcd/assigned", 0, expect.len() as u64).await;
        assert_eq!(sha1(&copy), sha1(&expect), "{id}'s copy differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_applied_with_a_stale_revision_changes_nothing() {
    let c = EtcdCluster::start(1, 1, TTL);
    // Revision 0: the journal must not exist yet.
    let yaml = "- {name: etcd/guarded, replication: 1, labels: {v: one}, revision: 0}\n";
    let (code, err) = apply_yaml(&c, yaml);
    assert_eq!(code, 0, "{err}");
    let (code, err) = apply_yaml(
        &c,
        "- {name: etcd/guarded, replication: 1, labels: {v: two}, revision: 0}\n",
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("ETCD_TRANSACTION_FAILED"), "{err}");

    let client = c.client(Duration::ZERO).await;
    let list = client.list("").await.expect("list");
    let j = list
        .iter()
        .find(|j| j.spec.name == "etcd/guarded")
        .expect("listed");
    assert_eq!(j.spec.labels.to_text(), "v=one");
    // The revision listed is the one to give back.
    let ok = format!(
        "- {{name: etcd/guarded, replication: 1, labels: {{v: two}}, revision: {}}}\n",
        j.revision
    );
    let (code, err) = apply_yaml(&c, &ok);
    assert_eq!(code, 0, "{err}");
    let stale = format!(
        "- {{name: etcd/guarded, replication: 1, labels: {{v: three}}, revision: {}}}\n",
        j.revision
    );
    let (code, err) = apply_yaml(&c, &stale);
    assert_eq!(code, 3, "{err}");
    let list = client.list("").await.expect("list");
    let j = list
        .iter()
        .find(|j| j.spec.name == "etcd/guarded")
        .expect("listed");
    assert_eq!(j.spec.labels.to_text(), "v=two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_and_then_a_replica_lose_no_acknowledged_append() {
    let mut c = EtcdCluster::start(4, 1, TTL);
    let journal = "etcd/failover";
    let (code, err) = apply_yaml(&c, &format!("- {{name: {journal}, replication: 3}}\n"));
    assert_eq!(code, 0, "{err}");
    let first = c.assigned(journal, 3).await;

    let client = c.client(WRITER_RETRY).await;
    let acked: Acked = Arc::default();
    let times: Times = Arc::default();
    let failures = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks = start_writers(&client, journal, 4, &acked, &times, &failures, &stop);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The primary dies.
    let primary = first.route.primary.clone();
    let killed_at = Instant::now();
    let i = c.index(&primary);
    c.brokers[i].kill9();
    let second = c.assigned(journal, 3).await;
    assert_ne!(second.route.primary, primary);
    wait_for_ack_after(&times, killed_at).await;
    eprintln!(
        "first acknowledged append {:?} after the primary was killed",
        first_ack_after(&times, killed_at).expect("an ack") - killed_at
    );

    // The killed primary comes back, as a new member, and the journal
    // has a broker to spare again; then a replica of the route dies.
    let old = c.index(&primary);
    c.brokers[old].start();
    let second = c.assigned(journal, 3).await;
    let replica = second
        .route
        .members
        .iter()
        .find(|m| **m != second.route.primary)
        .cloned()
        .expect("a replica");
    let killed_at = Instant::now();
    let i = c.index(&replica);
    c.brokers[i].kill9();
    wait_for_ack_after(&times, killed_at).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.expect("writer");
    }
    let failed = failures.lock().unwrap().clone();
    assert!(failed.is_empty(), "appends failed: {failed:#?}");

    // The journal has every acknowledged record, and each live member's
    // copy agrees with the primary's over what both hold.
    let last = c.assigned(journal, 3).await;
    let all = common::read_all(&client, journal).await;
    let acked = acked.lock().unwrap().clone();
    check_acked(&all, &acked);
    let primary = &c.brokers[c.index(&last.route.primary)];
    let head = all.len() as u64;
    let whole = pinned_copy(&primary.endpoint(), journal, 0, head).await;
    assert_eq!(sha1(&whole), sha1(&all));
    for id in &last.route.members {
        let b = &c.brokers[c.index(id)];
        // A replica added after the kills holds the bytes from its join on.
        let from = member_first_offset(&b.endpoint(), journal).await;
        let copy = pinned_copy(&b.endpoint(), journal, from, head).await;
        assert_eq!(
            sha1(&copy),
            sha1(&all[from as usize..]),
            "{id}'s copy from {from} differs"
        );
    }
    // The first primary came back as a new member: it serves none of the
    // bytes it held before (they were moved aside), only what it holds as
    // a member again, if the allocator gave the journal back to it.
    let pinned = Client::connect_pinned(&c.brokers[old].endpoint())
        .await
        .expect("connect");
    if !last.route.members.contains(&first.route.primary) {
        let r = read_range(&pinned, journal, 0, Some(head)).await;
        assert_eq!(status_of(r), Status::NOT_JOURNAL_BROKER);
    }
    let retired = c.brokers[old].data.join("retired");
    assert!(
        retired.is_dir(),
        "its earlier journal data is kept aside in {retired:?}"
    );
}

/// The first offset a member's own copy holds (0 unless it joined later).
async fn member_first_offset(endpoint: &str, journal: &str) -> u64 {
    let client = Client::connect_pinned(endpoint).await.expect("connect");
    let fragments = client.fragments(journal).await.expect("fragments");
    fragments.iter().map(|f| f.begin).min().unwrap_or(0)
}

/// The first ack of an append sent after `at`.
fn first_ack_after(times: &Times, at: Instant) -> Option<Instant> {
    times
        .lock()
        .unwrap()
        .iter()
        .filter(|(sent, _)| *sent > at)
        .map(|(_, acked)| *acked)
        .min()
}

async fn wait_for_ack_after(times: &Times, at: Instant) {
    let deadline = Instant::now() + WRITER_RETRY;
    while first_ack_after(times, at).is_none() {
        assert!(
            Instant::now() < deadline,
            "no append acknowledged after the fault"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
