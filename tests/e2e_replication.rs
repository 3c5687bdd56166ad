//! End-to-end: replication across real brokers of one cluster file. Every
//! acknowledged append is on every member of its route, byte for byte, at
//! the same offsets; a client or broker dying mid-append leaves no partial
//! append anywhere; a replica that was down catches up through the fragment
//! store; members killed and restarted in turn, and journals moved by
//! cluster-file changes between kills, lose no acknowledged append and end
//! with identical copies; brokers outside a route proxy to it (or refuse
//! when asked not to);
//! too few brokers refuse appends; routes follow the cluster file as it
//! changes, a broker a journal leaves uploads what only it held, and a
//! primary that lost its data copies what its replicas hold before it takes
//! appends again.
//!
//! Copies are compared through pinned clients (every request to one broker)
//! with DO_NOT_PROXY, so each broker answers from what it holds itself.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::cluster::{Cluster, ClusterBroker};
use common::store::TestStore;
use common::*;
use rand::{Rng, SeedableRng};
use rotary_net::client::{
    AppendOptions, Client, ClientError, ReadDone, ReadEvent, ReadOptions, RouteInfo,
    APPEND_CHUNK_LEN,
};
use rotary_net::spec::{Codec, JournalSpec, LabelSet};
use rotary_net::wire::{flag, AppendReply, AppendRequest, Op, ReadRequest};
use rotary_net::Status;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bound on every wait for the cluster to catch up (routes, uploads,
/// appends resuming).
const WAIT: Duration = Duration::from_secs(30);
/// How often waits poll.
const POLL: Duration = Duration::from_millis(50);
/// Bound on one append of the writers: an append that neither commits
/// nor fails in this long is reported as hung.
const APPEND_TIMEOUT: Duration = Duration::from_secs(20);
/// Shards per broker: one, so a broker's endpoint is its journal's shard.
const CORES: usize = 1;
/// Bound on each test: past it the test fails with the brokers' thread
/// states and logs rather than hanging.
const TEST_LIMIT: Duration = Duration::from_secs(90);
/// Largest ordinary record of the writers.
const RECORD_LEN_MAX: usize = 48 << 10;

fn spec(name: &str, replication: u32) -> JournalSpec {
    let mut s = JournalSpec::new(name);
    s.replication = replication;
    // Small fragments: the copies roll several times during a test.
    s.fragment.length = 1 << 20;
    s.fragment.compression_codec = Codec::None;
    s
}

fn store_spec(name: &str, replication: u32, store: &TestStore) -> JournalSpec {
    let mut s = spec(name, replication);
    s.fragment.stores = vec![store.url()];
    s.fragment.refresh_interval = Duration::from_secs(1);
    s
}

fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}

fn ids(route: &RouteInfo) -> Vec<String> {
    route.members.iter().map(|m| m.id.clone()).collect()
}

/// The journal's route as `at` answers it.
async fn route_at(b: &ClusterBroker, journal: &str) -> RouteInfo {
    let r = b
        .client()
        .await
        .route(journal)
        .await
        .unwrap_or_else(|e| panic!("ROUTE {journal} on {}: {e}", b.id));
    assert_eq!(r.broker, b.id, "ROUTE answered by {}: {r:?}", b.id);
    r
}

/// The route of `journal` once every listed, running broker has read the
/// cluster file as it is now (each looks every second): [`agreed_route`],
/// after waiting until they all answer one route of listed brokers.
async fn settled_route(cluster: &Cluster, journal: &str) -> RouteInfo {
    let listed: Vec<&str> = cluster
        .listed()
        .iter()
        .map(|&i| cluster.brokers[i].id.as_str())
        .collect();
    let deadline = Instant::now() + WAIT;
    loop {
        let mut routes = Vec::new();
        for &i in cluster.listed() {
            let b = &cluster.brokers[i];
            if b.is_running() {
                routes.push((b.id.clone(), ids(&route_at(b, journal).await)));
            }
        }
        let same = routes.iter().all(|(_, r)| *r == routes[0].1);
        if same && routes[0].1.iter().all(|m| listed.contains(&m.as_str())) {
            return agreed_route(cluster, journal).await;
        }
        assert!(
            Instant::now() < deadline,
            "the brokers listed ({listed:?}) still route {journal} differently after {WAIT:?}: \
             {routes:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The route every listed, running broker answers, checked to be the same
/// everywhere, with distinct members in distinct zones.
async fn agreed_route(cluster: &Cluster, journal: &str) -> RouteInfo {
    let first = &cluster.brokers[cluster.listed()[0]];
    let route = route_at(first, journal).await;
    for &i in cluster.listed() {
        let b = &cluster.brokers[i];
        if !b.is_running() {
            continue;
        }
        let r = route_at(b, journal).await;
        assert_eq!(
            r.members, route.members,
            "{} and {} disagree on the route of {journal}",
            first.id, b.id
        );
    }
    let mut seen_ids = HashSet::new();
    let mut seen_zones = HashSet::new();
    for m in &route.members {
        assert!(seen_ids.insert(m.id.clone()), "{route:?}");
        assert!(
            seen_zones.insert(m.zone.clone()),
            "two members in one zone: {route:?}"
        );
        let b = cluster.by_id(&m.id);
        assert_eq!(m.zone, b.zone, "{route:?}");
        assert_eq!(m.endpoint, b.endpoint(), "{route:?}");
    }
    route
}

/// Appends, retrying retryable refusals and broken connections until
/// [`WAIT`] runs out (a journal with stores refuses appends until its store
/// was first listed; a route may be settling).
async fn append_retrying(client: &Client, journal: &str, bytes: &[u8]) -> AppendReply {
    let deadline = Instant::now() + WAIT;
    loop {
        match client.append(&req(journal), bytes.to_vec()).await {
            Ok(r) => {
                assert_eq!(r.end - r.begin, bytes.len() as u64, "{r:?}");
                assert_eq!(r.sha1, sha1(bytes), "{r:?}");
                return r;
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(POLL).await;
            }
            Err(e) => panic!("append to {journal}: {e}"),
        }
    }
}

/// Appends to a journal whose spec was deleted until the broker says so
/// with JOURNAL_NOT_FOUND: until [`WAIT`] runs out the journal may still
/// take appends (a shard lets go of a journal whose spec is gone at its
/// next tick) or answer a retryable status; nothing else.
async fn append_until_not_found(client: &Client, journal: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let res = client.append(&req(journal), &b"late"[..]).await;
        match &res {
            Err(e) if e.status() == Some(Status::JOURNAL_NOT_FOUND) => return,
            Ok(_) if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(POLL).await
            }
            _ => panic!("append to {journal} through {}: {res:?}", client.endpoint()),
        }
    }
}

/// A non-blocking DO_NOT_PROXY read of `[from, to)` (to the head if `to` is
/// None): what this broker holds itself. Offsets must be contiguous; a
/// fragment location (history only in a store) fails the test.
async fn read_local(
    client: &Client,
    journal: &str,
    from: u64,
    to: Option<u64>,
) -> Result<(Vec<u8>, ReadDone), ClientError> {
    let options = ReadOptions {
        do_not_proxy: true,
        ..Default::default()
    };
    read_range_with(client, journal, from, to, options).await
}

/// Everything broker `b` holds of `journal`, `[0, head)`, read through a
/// pinned client with DO_NOT_PROXY.
async fn local_copy(b: &ClusterBroker, journal: &str) -> Vec<u8> {
    let client = b.pinned().await;
    let (bytes, done) = read_local(&client, journal, 0, None)
        .await
        .unwrap_or_else(|e| panic!("{}: read {journal}: {e}", b.id));
    if bytes.is_empty() {
        assert!(
            matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
            "{}: {done:?}",
            b.id
        );
    } else {
        assert_eq!(done.status, Status::OK, "{}: {done:?}", b.id);
        assert_eq!(done.offset, bytes.len() as u64, "{}: {done:?}", b.id);
        assert_eq!(done.write_head, bytes.len() as u64, "{}: {done:?}", b.id);
    }
    bytes
}

/// Broker `b`'s own write head of `journal` (metadata-only, DO_NOT_PROXY).
/// A broker that just started may not know the journal yet: it answers a
/// retryable status until it has learned its peers' specs.
async fn local_head(b: &ClusterBroker, journal: &str) -> u64 {
    let client = b.pinned().await;
    let r = ReadRequest {
        journal: journal.to_string(),
        offset: None,
        end_offset: None,
        route_revision: 0,
    };
    let options = ReadOptions {
        metadata_only: true,
        do_not_proxy: true,
        ..Default::default()
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let mut stream = client
            .read_with(&r, options)
            .await
            .unwrap_or_else(|e| panic!("{}: metadata read of {journal}: {e}", b.id));
        match stream.next().await.expect("READ_DONE") {
            Ok(ReadEvent::Done(done))
                if done.status.is_retryable()
                    && done.status != Status::OFFSET_NOT_YET_AVAILABLE
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(POLL).await;
            }
            Ok(ReadEvent::Done(done)) => {
                assert!(
                    matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
                    "{}: {done:?}",
                    b.id
                );
                return done.write_head;
            }
            other => panic!("{}: metadata read of {journal}: {other:?}", b.id),
        }
    }
}

/// `[0, head)` of `journal` through a pinned client's direct read: local
/// bytes from the broker, store-held fragments fetched from the store.
async fn direct_copy(b: &ClusterBroker, journal: &str) -> Vec<u8> {
    let client = b.pinned().await;
    let r = ReadRequest {
        journal: journal.to_string(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    };
    let mut stream = client.read_direct(&r, false);
    let mut out = Vec::new();
    loop {
        match stream.next().await.expect("READ_DONE") {
            Ok(ReadEvent::Data { offset, content }) => {
                assert_eq!(
                    offset,
                    out.len() as u64,
                    "{}: direct read of {journal} skipped [{}, {offset})",
                    b.id,
                    out.len()
                );
                out.extend_from_slice(&content);
            }
            Ok(ReadEvent::Fragment { .. }) => panic!("a direct read yields no locations"),
            Ok(ReadEvent::Done(d)) => {
                assert!(
                    matches!(d.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
                    "{}: {d:?}",
                    b.id
                );
                assert_eq!(d.offset, out.len() as u64, "{}: {d:?}", b.id);
                return out;
            }
            Err(e) => panic!("{}: direct read of {journal}: {e}", b.id),
        }
    }
}

/// An append the writer knows committed: where, and the SHA-1 the broker
/// reported.
#[derive(Clone, Debug)]
struct Acked {
    found: Found,
    sha1: [u8; 20],
}

fn acked(writer: u32, seq: u32, r: &AppendReply) -> Acked {
    Acked {
        found: Found {
            begin: r.begin,
            end: r.end,
            writer,
            seq,
        },
        sha1: r.sha1,
    }
}

/// Checks one broker's copy of a journal: only whole records; every
/// acknowledged append at its `[begin, end)` with its SHA-1; any other
/// record is one whose outcome its writer could not learn (`unknown`).
fn check_copy(
    who: &str,
    bytes: &[u8],
    acked: &[Acked],
    unknown: &HashSet<(u32, u32)>,
) -> Vec<Found> {
    let found = parse_records(bytes, 0).unwrap_or_else(|e| panic!("{who}: {e}"));
    let at: HashMap<u64, Found> = found.iter().map(|f| (f.begin, *f)).collect();
    for a in acked {
        assert_eq!(
            at.get(&a.found.begin),
            Some(&a.found),
            "{who}: acknowledged append missing or different at {} (copy holds {} bytes)",
            a.found.begin,
            bytes.len()
        );
        assert_eq!(
            sha1(&bytes[a.found.begin as usize..a.found.end as usize]),
            a.sha1,
            "{who}: SHA-1 of the acknowledged append at {}",
            a.found.begin
        );
    }
    let acked_ids: HashSet<(u32, u32)> = acked
        .iter()
        .map(|a| (a.found.writer, a.found.seq))
        .collect();
    let mut seen = HashSet::new();
    for f in &found {
        assert!(
            seen.insert((f.writer, f.seq)),
            "{who}: record ({}, {}) appears twice, again at {}",
            f.writer,
            f.seq,
            f.begin
        );
        assert!(
            acked_ids.contains(&(f.writer, f.seq)) || unknown.contains(&(f.writer, f.seq)),
            "{who}: record ({}, {}) at [{}, {}) was refused or never sent",
            f.writer,
            f.seq,
            f.begin,
            f.end
        );
    }
    found
}

/// Two copies of one journal agree on every offset both hold.
fn assert_prefix_consistent(a: (&str, &[u8]), b: (&str, &[u8])) {
    let n = a.1.len().min(b.1.len());
    if let Some(i) = (0..n).find(|&i| a.1[i] != b.1[i]) {
        panic!(
            "{} ({} bytes) and {} ({} bytes) differ at offset {i}",
            a.0,
            a.1.len(),
            b.0,
            b.1.len()
        );
    }
}

/// Record sizes of the writers: mostly small to mid, now and then one long
/// enough to go in several frames.
fn record_len(rng: &mut impl Rng) -> usize {
    if rng.gen_ratio(1, 80) {
        rng.gen_range(APPEND_CHUNK_LEN + 1..2 * APPEND_CHUNK_LEN + 4096)
    } else {
        log_uniform_size(rng, RECORD_HEADER_LEN, RECORD_LEN_MAX)
    }
}

// ---------------------------------------------------------------------------
// 1. Concurrent writers: three identical copies.

const COPIES_WRITERS: u32 = 6;
const COPIES_APPENDS: u32 = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_are_identical_on_every_replica() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        concurrent_appends_are_identical_on_every_replica_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn concurrent_appends_are_identical_on_every_replica_body(cluster: &mut Cluster) {
    let j = "repl/copies";
    cluster.apply(&[spec(j, 3)]).await;
    let route = agreed_route(cluster, j).await;
    assert_eq!(route.members.len(), 3, "{route:?}");

    // Writers share clients that follow routes from each broker, and
    // clients pinned on the replicas (which proxy appends to the primary).
    let mut clients = Vec::new();
    for b in &cluster.brokers {
        clients.push(b.client().await);
    }
    for m in &route.members[1..] {
        clients.push(cluster.by_id(&m.id).pinned().await);
    }
    let mut tasks = Vec::new();
    for writer in 0..COPIES_WRITERS {
        let client = clients[writer as usize % clients.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(0x5e9 ^ u64::from(writer));
            let mut out = Vec::new();
            for seq in 0..COPIES_APPENDS {
                let content = record(writer, seq, record_len(&mut rng));
                let r = client
                    .append(&req(j), content.clone())
                    .await
                    .unwrap_or_else(|e| panic!("writer {writer} append {seq}: {e}"));
                assert_eq!(r.end - r.begin, content.len() as u64, "{r:?}");
                assert_eq!(r.sha1, sha1(&content), "{r:?}");
                out.push(acked(writer, seq, &r));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let head = all.iter().map(|a| a.found.end).max().unwrap();

    // Acknowledged spans tile [0, head) exactly: nothing else committed.
    let mut spans: Vec<(u64, u64)> = all.iter().map(|a| (a.found.begin, a.found.end)).collect();
    spans.sort();
    let mut at = 0;
    for (begin, end) in spans {
        assert_eq!(begin, at, "acknowledged appends overlap or leave a gap");
        at = end;
    }
    assert_eq!(at, head);

    let none = HashSet::new();
    let mut digests = Vec::new();
    for b in &cluster.brokers {
        assert_eq!(local_head(b, j).await, head, "{}: write head", b.id);
        let copy = local_copy(b, j).await;
        assert_eq!(copy.len() as u64, head, "{}: copy length", b.id);
        let found = check_copy(&b.id, &copy, &all, &none);
        assert_eq!(found.len(), all.len(), "{}: records", b.id);
        digests.push((b.id.clone(), hex_sha1(&copy)));
    }
    eprintln!("{} appends, {head} bytes; copies: {digests:?}", all.len());
    assert!(
        digests.iter().all(|(_, d)| *d == digests[0].1),
        "copies differ: {digests:?}"
    );
}

// ---------------------------------------------------------------------------
// 1b. The two ingredients of the writers above, one at a time: appends of
// several frames, and fragments rolling while appends are in flight.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_of_several_frames_replicate() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        appends_of_several_frames_replicate_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn appends_of_several_frames_replicate_body(cluster: &mut Cluster) {
    let j = "repl/frames";
    cluster.apply(&[spec(j, 3)]).await;
    agreed_route(cluster, j).await;
    let client = cluster.brokers[0].client().await;
    let mut expected = Vec::new();
    // One frame; just over one frame; several frames.
    for (seq, len) in [100, APPEND_CHUNK_LEN + 1, 3 * APPEND_CHUNK_LEN + 17]
        .into_iter()
        .enumerate()
    {
        let c = record(7, seq as u32, len);
        let r = client
            .append(&req(j), c.clone())
            .await
            .unwrap_or_else(|e| panic!("append of {len} bytes at {}: {e}", expected.len()));
        assert_eq!(
            (r.begin, r.end, r.sha1),
            (
                expected.len() as u64,
                (expected.len() + len) as u64,
                sha1(&c)
            )
        );
        expected.extend_from_slice(&c);
    }
    // Streamed from a reader: as many frames as the reader's pauses make.
    let c = record(7, 3, 300_000);
    let r = client
        .append_stream(&req(j), std::io::Cursor::new(c.clone()))
        .await
        .unwrap_or_else(|e| panic!("streamed append at {}: {e}", expected.len()));
    assert_eq!((r.begin, r.sha1), (expected.len() as u64, sha1(&c)));
    expected.extend_from_slice(&c);
    for b in &cluster.brokers {
        let copy = local_copy(b, j).await;
        assert!(
            copy == expected,
            "{}: copy of {} bytes (SHA-1 {}), appended {} (SHA-1 {})",
            b.id,
            copy.len(),
            hex_sha1(&copy),
            expected.len(),
            hex_sha1(&expected)
        );
    }
}

/// Journals with one primary shard, each taking a large append at once:
/// one turn of the primary carries more content than one frame may.
const WIDE_JOURNALS: usize = 8;
const WIDE_APPEND_LEN: usize = 4 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_larger_than_a_frame_replicates() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_turn_larger_than_a_frame_replicates_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn a_turn_larger_than_a_frame_replicates_body(cluster: &mut Cluster) {
    // Journals whose primary is b1, so one shard stages all of them.
    let mut names = Vec::new();
    let mut specs = Vec::new();
    for i in 0.. {
        let j = format!("repl/wide-{i}");
        specs.push(spec(&j, 3));
        names.push(j);
        if names.len() == 4 * WIDE_JOURNALS {
            break;
        }
    }
    for s in &mut specs {
        s.fragment.length = 64 << 20;
    }
    cluster.apply(&specs).await;
    let mut chosen = Vec::new();
    for j in &names {
        if agreed_route(cluster, j).await.members[0].id == "b1" {
            chosen.push(j.clone());
        }
        if chosen.len() == WIDE_JOURNALS {
            break;
        }
    }
    assert!(
        chosen.len() >= 4,
        "too few journals with primary b1: {chosen:?}"
    );
    let client = cluster.by_id("b1").client().await;
    let appends: Vec<_> = chosen
        .iter()
        .enumerate()
        .map(|(i, j)| {
            let client = client.clone();
            let j = j.clone();
            tokio::spawn(async move {
                let c = record(i as u32, 0, WIDE_APPEND_LEN);
                let r = client
                    .append(&req(&j), c.clone())
                    .await
                    .unwrap_or_else(|e| panic!("{j}: {e}"));
                assert_eq!((r.begin, r.end, r.sha1), (0, c.len() as u64, sha1(&c)));
                (j, c)
            })
        })
        .collect();
    let mut written = Vec::new();
    for a in appends {
        written.push(a.await.expect("append task"));
    }
    for (j, c) in &written {
        for b in &cluster.brokers {
            let copy = local_copy(b, j).await;
            assert!(
                &copy == c,
                "{}: {j}: copy of {} bytes (SHA-1 {}), appended {} (SHA-1 {})",
                b.id,
                copy.len(),
                hex_sha1(&copy),
                c.len(),
                hex_sha1(c)
            );
        }
    }
}

const ROLL_WRITERS: u32 = 6;
const ROLL_APPENDS: u32 = 60;
const ROLL_FRAGMENT_LEN: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_roll_while_appends_are_in_flight() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        fragments_roll_while_appends_are_in_flight_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn fragments_roll_while_appends_are_in_flight_body(cluster: &mut Cluster) {
    let j = "repl/rolling";
    let mut s = spec(j, 3);
    s.fragment.length = ROLL_FRAGMENT_LEN;
    cluster.apply(&[s]).await;
    let route = agreed_route(cluster, j).await;
    let client = cluster.by_id(&route.members[0].id).client().await;
    let mut tasks = Vec::new();
    for writer in 0..ROLL_WRITERS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for seq in 0..ROLL_APPENDS {
                let content = record(writer, seq, 1000 + 97 * seq as usize);
                let r = tokio::time::timeout(APPEND_TIMEOUT, client.append(&req(j), content))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("writer {writer} append {seq}: no answer in {APPEND_TIMEOUT:?}")
                    })
                    .unwrap_or_else(|e| panic!("writer {writer} append {seq}: {e}"));
                out.push(acked(writer, seq, &r));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        match t.await {
            Ok(a) => all.extend(a),
            Err(e) => panic!("{e}\nbroker threads:\n{}", cluster.threads_report()),
        }
    }
    let head = all.iter().map(|a| a.found.end).max().unwrap();
    let none = HashSet::new();
    let mut digests = Vec::new();
    for b in &cluster.brokers {
        let copy = local_copy(b, j).await;
        assert_eq!(copy.len() as u64, head, "{}", b.id);
        check_copy(&b.id, &copy, &all, &none);
        digests.push(hex_sha1(&copy));
    }
    // The primary did roll, many times.
    let frags = client.fragments(j).await.unwrap();
    let sealed = frags.iter().filter(|f| !f.open).count() as u64;
    assert!(
        sealed >= head / ROLL_FRAGMENT_LEN / 2,
        "{sealed} sealed fragments for {head} bytes: {frags:#?}"
    );
    assert!(
        digests.iter().all(|d| *d == digests[0]),
        "copies differ: {digests:?}"
    );
}

// ---------------------------------------------------------------------------
// 2. A client dying mid-append: nothing of it on any member.

/// After an interrupted append: every member's head is still `expected`'s
/// length, the next append lands exactly there, and every member's copy is
/// `expected` plus it.
async fn assert_no_trace(cluster: &Cluster, j: &str, expected: &mut Vec<u8>, marker: &[u8]) {
    let head = expected.len() as u64;
    for b in &cluster.brokers {
        assert_eq!(
            local_head(b, j).await,
            head,
            "{}: the head moved after an interrupted append",
            b.id
        );
    }
    let client = cluster.brokers[0].client().await;
    let r = client
        .append(&req(j), marker.to_vec())
        .await
        .unwrap_or_else(|e| panic!("append after an interrupted one: {e}"));
    assert_eq!(
        (r.begin, r.end),
        (head, head + marker.len() as u64),
        "the next append after an interrupted one"
    );
    expected.extend_from_slice(marker);
    for b in &cluster.brokers {
        let copy = local_copy(b, j).await;
        assert!(
            copy == *expected,
            "{}: copy ({} bytes, SHA-1 {}) is not what was appended ({} bytes, SHA-1 {})",
            b.id,
            copy.len(),
            hex_sha1(&copy),
            expected.len(),
            hex_sha1(expected)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_killed_mid_append_leaves_no_trace_on_any_replica() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        client_killed_mid_append_leaves_no_trace_on_any_replica_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn client_killed_mid_append_leaves_no_trace_on_any_replica_body(cluster: &mut Cluster) {
    let j = "repl/dead-client";
    cluster.apply(&[spec(j, 3)]).await;
    let route = agreed_route(cluster, j).await;
    let primary = route.members[0].endpoint.clone();
    let replica = route.members[1].endpoint.clone();
    let meta = req(j).encode();
    let mut expected = Vec::new();
    assert_no_trace(cluster, j, &mut expected, b"first").await;

    // Let streamed content reach the replicas before the client dies.
    let settle = || tokio::time::sleep(Duration::from_millis(300));

    // 1. APPEND with MORE and some content, then the socket closes.
    let mut s = raw_connect(&primary);
    s.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta, &[b'y'; 5_000]))
        .unwrap();
    settle().await;
    drop(s);
    assert_no_trace(cluster, j, &mut expected, b"-second").await;

    // 2. Several whole chunks, then a chunk cut off in its payload.
    let mut s = raw_connect(&primary);
    s.write_all(&frame(Op::APPEND, flag::MORE, 7, &meta, &[b'a'; 64 << 10]))
        .unwrap();
    for _ in 0..3 {
        s.write_all(&frame(
            Op::APPEND_CHUNK,
            flag::MORE,
            7,
            &[],
            &vec![b'b'; APPEND_CHUNK_LEN],
        ))
        .unwrap();
    }
    let chunk = frame(Op::APPEND_CHUNK, 0, 7, &[], &[b'c'; 10_000]);
    s.write_all(&chunk[..chunk.len() - 3_000]).unwrap();
    settle().await;
    drop(s);
    assert_no_trace(cluster, j, &mut expected, b"-third").await;

    // 3. The same through a replica, which proxies it to the primary.
    let mut s = raw_connect(&replica);
    s.write_all(&frame(Op::APPEND, flag::MORE, 3, &meta, &[b'r'; 70_000]))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, flag::MORE, 3, &[], &[b's'; 9_000]))
        .unwrap();
    settle().await;
    drop(s);
    assert_no_trace(cluster, j, &mut expected, b"-fourth").await;

    // 4. An APPEND frame cut off in its payload.
    let whole = frame(Op::APPEND, 0, 4, &meta, &[b'x'; 20_000]);
    let mut s = raw_connect(&primary);
    s.write_all(&whole[..whole.len() - 5_000]).unwrap();
    settle().await;
    drop(s);
    assert_no_trace(cluster, j, &mut expected, b"-fifth").await;
}

// ---------------------------------------------------------------------------
// Writers for the kill tests.

/// Phases of a kill test, as the writers see them when an append starts
/// and when it ends.
const PHASE_BEFORE_KILL: u8 = 0;
/// Set just before the kill: failures from here on may be its doing.
const PHASE_KILLING: u8 = 1;
/// Set once the killed broker has been reaped: it is certainly down.
const PHASE_DOWN: u8 = 2;
/// Set just before the restart.
const PHASE_RESTARTED: u8 = 3;

#[derive(Default)]
struct WriterLog {
    acked: Vec<Acked>,
    /// Appends whose outcome is unknown (a retryable failure).
    unknown: HashSet<(u32, u32)>,
}

/// Which failures of an append the writers take as clear.
#[derive(Clone, Copy, PartialEq)]
enum Failures {
    /// A broken connection or `REPLICATION_FAILED`: one member of the route
    /// goes down once, and the writers follow routes to the primary.
    OfReplication,
    /// Any retryable status: members go down and come back in turn, and
    /// writers go through brokers that may be down or still starting.
    AnyRetryable,
}

struct Writers {
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicU8>,
    /// Per writer: failures of appends started and ended while down.
    failed_down: Arc<Vec<AtomicU32>>,
    /// Per writer: commits of appends started after the restart.
    acked_restarted: Arc<Vec<AtomicU32>>,
    /// What must not happen: failures before any kill, statuses other than
    /// REPLICATION_FAILED, hangs, commits while a member was down.
    wrong: Arc<std::sync::Mutex<Vec<String>>>,
    /// How often each kind of failure was seen.
    failures: Arc<std::sync::Mutex<HashMap<String, u32>>>,
    tasks: Vec<tokio::task::JoinHandle<WriterLog>>,
}

impl Writers {
    /// Starts `clients.len()` writers, one per client, appending records
    /// until stopped. With `stop_on_error` a writer ends at its first
    /// failure.
    fn start(j: &'static str, clients: Vec<Client>, stop_on_error: bool) -> Writers {
        Writers::start_taking(j, clients, stop_on_error, Failures::OfReplication)
    }

    /// As [`Writers::start`], taking `clear` failures as clear.
    fn start_taking(
        j: &'static str,
        clients: Vec<Client>,
        stop_on_error: bool,
        clear: Failures,
    ) -> Writers {
        let n = clients.len();
        let mut w = Writers {
            stop: Arc::new(AtomicBool::new(false)),
            phase: Arc::new(AtomicU8::new(PHASE_BEFORE_KILL)),
            failed_down: Arc::new((0..n).map(|_| AtomicU32::new(0)).collect()),
            acked_restarted: Arc::new((0..n).map(|_| AtomicU32::new(0)).collect()),
            wrong: Arc::default(),
            failures: Arc::default(),
            tasks: Vec::new(),
        };
        for (i, client) in clients.into_iter().enumerate() {
            let writer = i as u32;
            let stop = w.stop.clone();
            let phase = w.phase.clone();
            let failed_down = w.failed_down.clone();
            let acked_restarted = w.acked_restarted.clone();
            let wrong = w.wrong.clone();
            let wrong = move |what: String| wrong.lock().unwrap().push(what);
            let failures = w.failures.clone();
            w.tasks.push(tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(0xdead ^ u64::from(writer));
                let mut log = WriterLog::default();
                let mut seq = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let content = record(writer, seq, record_len(&mut rng));
                    let started = phase.load(Ordering::SeqCst);
                    let r = tokio::time::timeout(
                        APPEND_TIMEOUT,
                        client.append(&req(j), content.clone()),
                    )
                    .await;
                    let ended = phase.load(Ordering::SeqCst);
                    match r {
                        Ok(Ok(r)) => {
                            if (r.end - r.begin, r.sha1) != (content.len() as u64, sha1(&content)) {
                                wrong(format!(
                                    "writer {writer} append {seq}: reply {r:?} does not match \
                                     {} bytes with SHA-1 {}",
                                    content.len(),
                                    hex_sha1(&content)
                                ));
                            }
                            if started == PHASE_DOWN && ended == PHASE_DOWN {
                                wrong(format!(
                                    "writer {writer} append {seq} committed at [{}, {}) while a \
                                     member of the route was down",
                                    r.begin, r.end
                                ));
                            }
                            if started == PHASE_RESTARTED {
                                acked_restarted[i].fetch_add(1, Ordering::SeqCst);
                            }
                            log.acked.push(acked(writer, seq, &r));
                        }
                        Ok(Err(e)) => {
                            let kind = match e.status() {
                                Some(status) => format!("{status:?}"),
                                None => "broken connection".to_string(),
                            };
                            *failures.lock().unwrap().entry(kind).or_default() += 1;
                            let clear = matches!(e, ClientError::Io { .. })
                                || e.status() == Some(Status::REPLICATION_FAILED)
                                || clear == Failures::AnyRetryable;
                            if started == PHASE_BEFORE_KILL && ended == PHASE_BEFORE_KILL {
                                wrong(format!(
                                    "writer {writer} append {seq} failed before any broker was \
                                     killed: {e}"
                                ));
                            } else if !clear || !e.is_retryable() {
                                wrong(format!(
                                    "writer {writer} append {seq} (phase {started}..{ended}): {e} \
                                     (status {:?})",
                                    e.status()
                                ));
                            }
                            log.unknown.insert((writer, seq));
                            if started == PHASE_DOWN && ended == PHASE_DOWN {
                                failed_down[i].fetch_add(1, Ordering::SeqCst);
                            }
                            if stop_on_error {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(_) => {
                            wrong(format!(
                                "writer {writer} append {seq} (phase {started}): no answer in \
                                 {APPEND_TIMEOUT:?}"
                            ));
                            log.unknown.insert((writer, seq));
                            if stop_on_error {
                                break;
                            }
                        }
                    }
                    seq += 1;
                }
                log
            }));
        }
        w
    }

    fn set_phase(&self, p: u8) {
        self.phase.store(p, Ordering::SeqCst);
    }

    /// Waits until `counter` of every writer reaches `n`, for at most `limit`.
    async fn wait_each(
        &self,
        cluster: &Cluster,
        what: &str,
        counter: &[AtomicU32],
        n: u32,
        limit: Duration,
    ) {
        let deadline = Instant::now() + limit;
        loop {
            let counts: Vec<u32> = counter.iter().map(|c| c.load(Ordering::SeqCst)).collect();
            if counts.iter().all(|&c| c >= n) {
                return;
            }
            if self.tasks.iter().any(|t| t.is_finished()) {
                panic!("a writer ended early while waiting for {what}: {counts:?}");
            }
            if Instant::now() > deadline {
                panic!(
                    "not every writer saw {n} {what} within {limit:?}: {counts:?}\n{}",
                    self.problems(cluster)
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until `counter` of every writer has grown by `more`, for at
    /// most `limit`.
    async fn wait_each_more(
        &self,
        cluster: &Cluster,
        what: &str,
        counter: &[AtomicU32],
        more: u32,
        limit: Duration,
    ) {
        let from: Vec<u32> = counter.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        let deadline = Instant::now() + limit;
        loop {
            let counts: Vec<u32> = counter.iter().map(|c| c.load(Ordering::SeqCst)).collect();
            if counts.iter().zip(&from).all(|(&c, &f)| c >= f + more) {
                return;
            }
            if self.tasks.iter().any(|t| t.is_finished()) {
                panic!("a writer ended early while waiting for {what}: {counts:?}");
            }
            if Instant::now() > deadline {
                panic!(
                    "not every writer saw {more} more {what} within {limit:?}: {from:?} -> \
                     {counts:?}\n{}",
                    self.problems(cluster)
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until broker `at`'s copy of `journal` is at least `bytes` long.
    async fn wait_progress(&self, cluster: &Cluster, at: usize, journal: &str, bytes: u64) {
        let b = &cluster.brokers[at];
        let deadline = Instant::now() + WAIT;
        loop {
            let head = local_head(b, journal).await;
            if head >= bytes {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "{}: {journal} at {head}, not {bytes} bytes, after {WAIT:?}\n{}",
                    b.id,
                    self.problems(cluster)
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// What went wrong so far, and the brokers' threads.
    fn problems(&self, cluster: &Cluster) -> String {
        let wrong = self.wrong.lock().unwrap();
        let shown = wrong.len().min(20);
        format!(
            "{} appends went wrong so far; the first {shown}:\n{}\nbroker threads:\n{}",
            wrong.len(),
            wrong[..shown].join("\n"),
            cluster.threads_report()
        )
    }

    async fn finish(self) -> (Vec<Acked>, HashSet<(u32, u32)>) {
        self.stop.store(true, Ordering::SeqCst);
        let mut acked = Vec::new();
        let mut unknown = HashSet::new();
        for t in self.tasks {
            let log = t.await.unwrap();
            acked.extend(log.acked);
            unknown.extend(log.unknown);
        }
        let wrong = self.wrong.lock().unwrap();
        assert!(
            wrong.is_empty(),
            "{} appends went wrong:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
        (acked, unknown)
    }
}

/// Whether `frags` that live in a store (not `local`) chain from 0 to `head`.
fn store_covers(frags: &[rotary_net::client::FragmentInfo], head: u64) -> bool {
    let mut stored: Vec<(u64, u64)> = frags
        .iter()
        .filter(|f| f.store != "local")
        .map(|f| (f.begin, f.end))
        .collect();
    stored.sort();
    let mut at = 0;
    for (begin, end) in stored {
        if begin > at {
            return false;
        }
        at = at.max(end);
    }
    at >= head
}

// ---------------------------------------------------------------------------
// 3. A replica killed while writers run.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_under_load_fails_appends_cleanly_and_catches_up() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        replica_fault_under_load_body(&mut cluster, &store, ReplicaFault::Kill9),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

// ---------------------------------------------------------------------------
// 3b. A replica that stops answering (a hung process: SIGSTOP) while
// writers run. Unlike a killed one, its connections stay open and what was
// sent to it waits in its sockets: it reads all of it once it runs again,
// proposals of appends its primary has since failed included.

/// The primary's `--replica-ack-timeout` in the stopped-replica test.
const STOPPED_ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// Three brokers, listed and started with `--replica-ack-timeout`
/// [`STOPPED_ACK_TIMEOUT`].
fn start_with_short_ack_timeout() -> Cluster {
    start_with_ack_timeout(3, STOPPED_ACK_TIMEOUT, false)
}

/// `n` brokers, listed and started with `--replica-ack-timeout timeout`;
/// with `own_files`, each reads a cluster file of its own
/// ([`Cluster::write_own_file`]).
fn start_with_ack_timeout(n: usize, timeout: Duration, own_files: bool) -> Cluster {
    let mut cluster = Cluster::start_listed(n, CORES, &[]);
    let all: Vec<usize> = (0..n).collect();
    cluster.write_file(&all);
    let timeout = format!("{}s", timeout.as_secs());
    for i in 0..n {
        if own_files {
            cluster.write_own_file(i, &all);
        }
        let b = &mut cluster.brokers[i];
        b.serve_args = vec!["--replica-ack-timeout".into(), timeout.clone()];
        b.start();
    }
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_answering_fails_appends_cleanly_and_catches_up() {
    let store = TestStore::file();
    let mut cluster = tokio::task::block_in_place(start_with_short_ack_timeout);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        replica_fault_under_load_body(&mut cluster, &store, ReplicaFault::Stop),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplicaFault {
    /// `kill -9`, then a restart on the same disk and ports.
    Kill9,
    /// SIGSTOP, then SIGCONT.
    Stop,
}

async fn replica_fault_under_load_body(
    cluster: &mut Cluster,
    store: &TestStore,
    fault: ReplicaFault,
) {
    let j: &'static str = match fault {
        ReplicaFault::Kill9 => "repl/replica-kill",
        ReplicaFault::Stop => "repl/replica-stop",
    };
    cluster.apply(&[store_spec(j, 3, store)]).await;
    let route = agreed_route(cluster, j).await;
    let primary = cluster.index(&route.members[0].id);
    let victim = cluster.index(&route.members[1].id);
    let survivor = cluster.index(&route.members[2].id);

    // The journal takes appends once its store is listed.
    let warm = record(100, 0, 100);
    let warm_reply = append_retrying(&cluster.brokers[primary].client().await, j, &warm).await;
    let mut acked_all = vec![acked(100, 0, &warm_reply)];

    // Three writers follow routes to the primary; one goes through the
    // surviving replica, which proxies to the primary.
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(cluster.brokers[primary].client().await);
    }
    clients.push(cluster.brokers[survivor].pinned().await);
    let writers = Writers::start(j, clients, false);
    writers.wait_progress(cluster, survivor, j, 1 << 20).await;

    writers.set_phase(PHASE_KILLING);
    let stopped = match fault {
        ReplicaFault::Kill9 => {
            tokio::task::block_in_place(|| cluster.brokers[victim].kill9());
            None
        }
        ReplicaFault::Stop => {
            let pid = cluster.brokers[victim].pid().expect("replica running");
            tokio::task::block_in_place(|| stop_process(pid));
            Some(pid)
        }
    };
    writers.set_phase(PHASE_DOWN);
    writers
        .wait_each(
            cluster,
            "failed appends while the replica is down",
            &writers.failed_down,
            3,
            WAIT,
        )
        .await;

    // What the survivors hold meanwhile: whole records, one offset space.
    // (Direct reads: a replica drops its local fragments once the store
    // lists them, which a long fault gives time for.)
    let p_copy = direct_copy(&cluster.brokers[primary], j).await;
    let s_copy = direct_copy(&cluster.brokers[survivor], j).await;
    let any: HashSet<(u32, u32)> = parse_records(&p_copy, 0)
        .unwrap_or_else(|e| panic!("primary while the replica is down: {e}"))
        .into_iter()
        .chain(
            parse_records(&s_copy, 0)
                .unwrap_or_else(|e| panic!("surviving replica while the replica is down: {e}")),
        )
        .map(|f| (f.writer, f.seq))
        .collect();
    assert!(!any.is_empty());
    assert_prefix_consistent(("primary", &p_copy), ("surviving replica", &s_copy));

    if fault == ReplicaFault::Stop {
        // The primary gave up on the silent replica by its ack timeout (its
        // connection never broke). The pipeline logs each time it does;
        // the failure it causes is logged once a minute per replica, and
        // may be preceded there by another of the same minute.
        let log = cluster.brokers[primary].log();
        let gave_up = "no ack from replica in time; closing the pipeline";
        assert!(
            log.contains(gave_up),
            "no {gave_up:?} in the primary's log:\n{log}"
        );
    }

    // The replica comes back (on its own disk and ports, or where it
    // stopped); appends resume.
    writers.set_phase(PHASE_RESTARTED);
    match stopped {
        None => tokio::task::block_in_place(|| cluster.brokers[victim].start()),
        Some(pid) => continue_process(pid),
    }
    writers
        .wait_each(
            cluster,
            "commits after the restart",
            &writers.acked_restarted,
            5,
            WAIT,
        )
        .await;
    let (acked, unknown) = writers.finish().await;
    acked_all.extend(acked);
    eprintln!(
        "{} appends acknowledged, {} with unknown outcome",
        acked_all.len(),
        unknown.len()
    );

    // Seal, let the primary upload, and let every member list the uploads.
    converged_at_the_head(cluster, primary, j, &acked_all, &unknown).await;
}

/// [`converged_through_the_store`] at the primary's head, which must be at
/// or past every acknowledged append.
async fn converged_at_the_head(
    cluster: &Cluster,
    primary: usize,
    j: &str,
    acked_all: &[Acked],
    unknown: &HashSet<(u32, u32)>,
) {
    let head = local_head(&cluster.brokers[primary], j).await;
    let max_acked = acked_all.iter().map(|a| a.found.end).max().unwrap();
    assert!(
        head >= max_acked,
        "head {head} < acknowledged end {max_acked}"
    );
    converged_through_the_store(cluster, primary, j, head, acked_all, unknown).await;
}

/// The seed of a test's draws: `ROTARY_TEST_SEED` when set, else `default`.
fn test_seed(default: u64) -> u64 {
    std::env::var("ROTARY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Seals `j` on its primary, waits until every broker the cluster file
/// lists (each a member of `j`'s route) lists store fragments covering
/// `[0, head)`, and checks that every member reads the
/// same `head` bytes (what it missed, from the store), holding every
/// acknowledged append.
async fn converged_through_the_store(
    cluster: &Cluster,
    primary: usize,
    j: &str,
    head: u64,
    acked_all: &[Acked],
    unknown: &HashSet<(u32, u32)>,
) {
    cluster.brokers[primary]
        .pinned()
        .await
        .seal(j)
        .await
        .expect("seal on the primary");
    for b in cluster.listed().iter().map(|&i| &cluster.brokers[i]) {
        let client = b.pinned().await;
        let deadline = Instant::now() + WAIT;
        loop {
            let frags = client
                .fragments(j)
                .await
                .unwrap_or_else(|e| panic!("{}: fragments: {e}", b.id));
            if store_covers(&frags, head) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: store fragments do not cover [0, {head}) within {WAIT:?}: {frags:#?}",
                b.id
            );
            tokio::time::sleep(POLL).await;
        }
    }

    // Every member reads the same journal, holding every acknowledged append.
    let mut digests = Vec::new();
    let mut first: Option<Vec<u8>> = None;
    for b in cluster.listed().iter().map(|&i| &cluster.brokers[i]) {
        assert_eq!(local_head(b, j).await, head, "{}: write head", b.id);
        let copy = direct_copy(b, j).await;
        assert_eq!(copy.len() as u64, head, "{}: readable length", b.id);
        check_copy(&b.id, &copy, acked_all, unknown);
        digests.push((b.id.clone(), hex_sha1(&copy)));
        match &first {
            None => first = Some(copy),
            Some(f) => assert_prefix_consistent(("first member", f), (&b.id, &copy)),
        }
    }
    assert!(
        digests.iter().all(|(_, d)| *d == digests[0].1),
        "copies differ: {digests:?}"
    );
}

// ---------------------------------------------------------------------------
// 4. The primary killed while writers run.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_killed_under_load_loses_no_acknowledged_append() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        primary_killed_under_load_loses_no_acknowledged_append_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn primary_killed_under_load_loses_no_acknowledged_append_body(cluster: &mut Cluster) {
    const J: &str = "repl/primary-kill";
    cluster.apply(&[spec(J, 3)]).await;
    let route = agreed_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);
    let replicas = [
        cluster.index(&route.members[1].id),
        cluster.index(&route.members[2].id),
    ];

    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(cluster.brokers[primary].client().await);
    }
    let writers = Writers::start(J, clients, true);
    writers
        .wait_progress(cluster, replicas[0], J, 2 << 20)
        .await;
    writers.set_phase(PHASE_KILLING);
    tokio::task::block_in_place(|| cluster.brokers[primary].kill9());
    writers.set_phase(PHASE_DOWN);
    let (acked, unknown) = writers.finish().await;
    assert!(
        acked.len() > 20,
        "only {} appends acknowledged",
        acked.len()
    );
    // Each writer had at most one append in flight when the primary died.
    assert!(unknown.len() <= 4, "{unknown:?}");

    let mut copies = Vec::new();
    for &i in &replicas {
        let b = &cluster.brokers[i];
        let copy = local_copy(b, J).await;
        let found = check_copy(&b.id, &copy, &acked, &unknown);
        eprintln!(
            "{}: {} bytes, {} records ({} acknowledged)",
            b.id,
            copy.len(),
            found.len(),
            acked.len()
        );
        copies.push((b.id.clone(), copy));
    }
    assert_prefix_consistent((&copies[0].0, &copies[0].1), (&copies[1].0, &copies[1].1));
}

// ---------------------------------------------------------------------------
// 4b. Members killed and restarted in turn while writers run: the primary
// or a replica, chosen by a seeded draw, down for a drawn while, then back
// on its own disk. No acknowledged append is ever lost or changed, none
// commits while a member is down, appends resume after each restart, and
// every member ends with the same journal.

/// Kills (and restarts) in the test below.
const CHAOS_ROUNDS: u32 = 12;
/// Commits each writer makes after each restart before the next kill.
const CHAOS_COMMITS: u32 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_killed_in_turn_lose_no_acknowledged_append() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(3, CORES);
    let limit = TEST_LIMIT * 2;
    let done = tokio::time::timeout(
        limit,
        members_killed_in_turn_lose_no_acknowledged_append_body(&mut cluster, &store),
    )
    .await;
    cluster.finished(done, limit);
}

async fn members_killed_in_turn_lose_no_acknowledged_append_body(
    cluster: &mut Cluster,
    store: &TestStore,
) {
    const J: &str = "repl/killed-in-turn";
    cluster.apply(&[store_spec(J, 3, store)]).await;
    let route = agreed_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);

    let warm = record(100, 0, 100);
    let warm_reply = append_retrying(&cluster.brokers[primary].client().await, J, &warm).await;
    let mut acked_all = vec![acked(100, 0, &warm_reply)];

    // Two writers follow routes (to the primary), one through each broker;
    // two more go through one replica each, which proxies to the primary.
    let mut clients = Vec::new();
    for b in &cluster.brokers {
        clients.push(b.client().await);
    }
    for m in &route.members[1..] {
        clients.push(cluster.by_id(&m.id).pinned().await);
    }
    let writers = Writers::start_taking(J, clients, false, Failures::AnyRetryable);
    writers.wait_progress(cluster, primary, J, 256 << 10).await;

    // `ROTARY_TEST_SEED` draws other victims and downtimes.
    let seed = test_seed(0x6b696c6c);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut victims = Vec::new();
    for round in 0..CHAOS_ROUNDS {
        // One member, two, or all three at once, down for a drawn while; most rounds
        // then wait for commits, the others kill again at once, while the
        // restarted brokers are still starting.
        let n = cluster.brokers.len();
        let first = rng.gen_range(0..n);
        let mut down_now = vec![first];
        match rng.gen_range(0..10) {
            0..=1 => down_now.push((first + rng.gen_range(1..n)) % n),
            2 => down_now = (0..n).collect(),
            _ => {}
        }
        // A single member is sometimes stopped (SIGSTOP) instead, then let
        // go on where it stopped.
        let hang = down_now.len() == 1 && rng.gen_bool(0.3);
        let down = Duration::from_millis(rng.gen_range(0..1500));
        let settle = round + 1 == CHAOS_ROUNDS || rng.gen_bool(0.7);
        let ids: Vec<String> = down_now
            .iter()
            .map(|&i| cluster.brokers[i].id.clone())
            .collect();
        victims.push((
            ids.clone(),
            if hang { "stop" } else { "kill" },
            down,
            settle,
        ));
        writers.set_phase(PHASE_KILLING);
        let mut stopped = Vec::new();
        for &i in &down_now {
            if hang {
                let pid = cluster.brokers[i].pid().expect("broker running");
                tokio::task::block_in_place(|| stop_process(pid));
                stopped.push(pid);
            } else {
                tokio::task::block_in_place(|| cluster.brokers[i].kill9());
            }
        }
        writers.set_phase(PHASE_DOWN);
        tokio::time::sleep(down).await;
        writers.set_phase(PHASE_RESTARTED);
        if hang {
            stopped.into_iter().for_each(continue_process);
        } else {
            for &i in &down_now {
                tokio::task::block_in_place(|| cluster.brokers[i].start());
            }
        }
        if settle {
            writers
                .wait_each_more(
                    cluster,
                    &format!("commits after restart {} ({ids:?})", round + 1),
                    &writers.acked_restarted,
                    CHAOS_COMMITS,
                    WAIT,
                )
                .await;
        }
    }
    let failures = writers.failures.lock().unwrap().clone();
    let (acked, unknown) = writers.finish().await;
    acked_all.extend(acked);
    eprintln!(
        "seed {seed}, primary {}, killed in turn: {victims:?}; {} appends acknowledged, {} with unknown outcome; \
         failures: {failures:?}",
        cluster.brokers[primary].id,
        acked_all.len(),
        unknown.len()
    );

    converged_at_the_head(cluster, primary, J, &acked_all, &unknown).await;
}

// ---------------------------------------------------------------------------
// 4c. The cluster file changes while writers run, and members are killed
// between the changes: four brokers, three listed at a time, a journal of
// replication 3, so each change moves the journal off one broker and onto
// another. No acknowledged append is lost or changed, appends resume after
// each step, and the members at the end hold the same journal.

/// Steps (file changes and kills) in the test below.
const MOVES: u32 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_moved_and_its_members_killed_loses_no_acknowledged_append() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(4, CORES);
    let limit = TEST_LIMIT * 2;
    let done = tokio::time::timeout(
        limit,
        a_journal_moved_and_its_members_killed_loses_no_acknowledged_append_body(
            &mut cluster,
            &store,
        ),
    )
    .await;
    cluster.finished(done, limit);
}

async fn a_journal_moved_and_its_members_killed_loses_no_acknowledged_append_body(
    cluster: &mut Cluster,
    store: &TestStore,
) {
    const J: &str = "repl/moved-and-killed";
    let n = cluster.brokers.len();
    cluster.write_file(&[0, 1, 2]);
    cluster.apply(&[store_spec(J, 3, store)]).await;
    let route = agreed_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);
    let warm = record(100, 0, 100);
    let warm_reply = append_retrying(&cluster.brokers[primary].client().await, J, &warm).await;
    let mut acked_all = vec![acked(100, 0, &warm_reply)];

    // One writer through each broker, listed or not, which proxies to the
    // primary of the moment; two more follow routes.
    let mut clients = Vec::new();
    for b in &cluster.brokers {
        clients.push(b.pinned().await);
    }
    for b in &cluster.brokers[..2] {
        clients.push(b.client().await);
    }
    let writers = Writers::start_taking(J, clients, false, Failures::AnyRetryable);
    writers.wait_progress(cluster, primary, J, 256 << 10).await;

    let seed = test_seed(0x6d6f7665);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut steps = Vec::new();
    for step in 0..MOVES {
        writers.set_phase(PHASE_KILLING);
        if step % 2 == 0 {
            // The broker left out of the file changes.
            let out = rng.gen_range(0..n);
            let listed: Vec<usize> = (0..n).filter(|&i| i != out).collect();
            steps.push(format!("without {}", cluster.brokers[out].id));
            cluster.write_file(&listed);
        } else {
            // (A broker the file does not list does not start.)
            let victim = cluster.listed()[rng.gen_range(0..n - 1)];
            let down = Duration::from_millis(rng.gen_range(0..1000));
            steps.push(format!("kill {} for {down:?}", cluster.brokers[victim].id));
            tokio::task::block_in_place(|| cluster.brokers[victim].kill9());
            tokio::time::sleep(down).await;
            tokio::task::block_in_place(|| cluster.brokers[victim].start());
        }
        writers.set_phase(PHASE_RESTARTED);
        writers
            .wait_each_more(
                cluster,
                &format!("commits after step {} ({})", step + 1, steps[step as usize]),
                &writers.acked_restarted,
                CHAOS_COMMITS,
                WAIT,
            )
            .await;
    }
    let failures = writers.failures.lock().unwrap().clone();
    let (acked, unknown) = writers.finish().await;
    acked_all.extend(acked);
    let route = settled_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);
    eprintln!(
        "seed {seed}: {steps:?}; route at the end {:?}; {} appends acknowledged, {} with \
         unknown outcome; failures: {failures:?}",
        ids(&route),
        acked_all.len(),
        unknown.len()
    );

    converged_at_the_head(cluster, primary, J, &acked_all, &unknown).await;
}

/// How long a primary waits for a replica's ack in tests where an append
/// answered only at that timeout is a fault: longer than they may take.
const LONG_ACK_TIMEOUT: Duration = Duration::from_secs(600);

/// A replica whose view drops it from a journal's route, while it holds
/// part of an append its primary streamed to it, answers that append with
/// WRONG_ROUTE: the primary, which still routes the journal through it,
/// fails the append at once instead of at its ack timeout. Once the views
/// agree again, appends go on and every member holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_leaves_the_route_answers_its_primary_at_once() {
    let mut cluster =
        tokio::task::block_in_place(|| start_with_ack_timeout(3, LONG_ACK_TIMEOUT, true));
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_replica_that_leaves_the_route_answers_its_primary_at_once_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn a_replica_that_leaves_the_route_answers_its_primary_at_once_body(cluster: &mut Cluster) {
    const J: &str = "repl/replica-left";
    cluster.apply(&[spec(J, 3)]).await;
    let route = agreed_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);
    let left = cluster.index(&route.members[1].id);
    let left_id = cluster.brokers[left].id.clone();
    let client = cluster.brokers[primary].client().await;
    let before = append_retrying(&client, J, b"before;").await;
    let failed_before = client.stats().await.unwrap()["replication_failed"]
        .as_u64()
        .unwrap();

    // Part of an append, streamed on to both replicas.
    let mut s = raw_connect(&cluster.brokers[primary].endpoint());
    s.write_all(&frame(
        Op::APPEND,
        flag::MORE,
        1,
        &req(J).encode(),
        &[b'x'; 5_000],
    ))
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Only the replica hears that it left the route.
    let others: Vec<usize> = (0..3).filter(|&i| i != left).collect();
    cluster.write_own_file(left, &others);
    let deadline = Instant::now() + WAIT;
    while ids(&route_at(&cluster.brokers[left], J).await).contains(&left_id) {
        assert!(
            Instant::now() < deadline,
            "{left_id} still routes {J} through itself"
        );
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(
        ids(&route_at(&cluster.brokers[primary], J).await),
        ids(&route),
        "the primary's view changed too"
    );

    // The rest of the append: the primary commits it and waits for acks.
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], &[b'y'; 5_000]))
        .unwrap();
    let f = tokio::task::block_in_place(|| read_raw_frame(&mut s))
        .expect("the append's reply before the socket's read timeout")
        .expect("a reply, not a closed connection");
    let message = String::from_utf8_lossy(&f.payload);
    assert_eq!(
        (f.op, Status::from_code(f.status)),
        (Op::APPEND_REPLY, Some(Status::REPLICATION_FAILED)),
        "{f:?} ({message})"
    );
    assert!(
        message.contains(&format!("replica {left_id} answered WRONG_ROUTE")),
        "{message}"
    );
    // The primary counts the answer.
    let failed = client.stats().await.unwrap()["replication_failed"]
        .as_u64()
        .unwrap();
    assert_eq!(failed - failed_before, 1);

    // The views agree again: appends go on, and every member holds them.
    cluster.write_own_file(left, &[0, 1, 2]);
    let after = append_retrying(&client, J, b"after;").await;
    assert!(after.begin >= before.end, "{before:?} {after:?}");
    for b in &cluster.brokers {
        let c = b.pinned().await;
        for (r, bytes) in [(&before, &b"before;"[..]), (&after, &b"after;"[..])] {
            let (got, _) = read_local(&c, J, r.begin, Some(r.end))
                .await
                .unwrap_or_else(|e| panic!("{}: read {J}: {e}", b.id));
            assert_eq!(got, bytes, "{}: [{}, {})", b.id, r.begin, r.end);
        }
    }
}

/// A primary waits for each journal's acks on its own: while one replica
/// is stopped (SIGSTOP), a journal of the same primary shard routed
/// through another replica goes on appending, and the stopped replica's
/// journal completes its append once the replica runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_holds_up_only_its_own_journals() {
    let mut cluster =
        tokio::task::block_in_place(|| start_with_ack_timeout(4, LONG_ACK_TIMEOUT, false));
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_stopped_replica_holds_up_only_its_own_journals_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn a_stopped_replica_holds_up_only_its_own_journals_body(cluster: &mut Cluster) {
    // Two journals of one primary, each with a replica of its own.
    let specs: Vec<JournalSpec> = (0..32)
        .map(|i| spec(&format!("repl/own-acks-{i}"), 2))
        .collect();
    cluster.apply(&specs).await;
    let mut routes = Vec::new();
    for s in &specs {
        routes.push((s.name.clone(), ids(&agreed_route(cluster, &s.name).await)));
    }
    let (slow, fast) = routes
        .iter()
        .flat_map(|a| routes.iter().map(move |b| (a, b)))
        .find(|(a, b)| a.1[0] == b.1[0] && a.1[1] != b.1[1])
        .expect("two of 32 journals with one primary and different replicas");
    let primary = cluster.by_id(&slow.1[0]);
    let client = primary.client().await;
    for j in [&slow.0, &fast.0] {
        append_retrying(&client, j, b"warm;").await;
    }

    let stopped = cluster.by_id(&slow.1[1]).pid().expect("running");
    tokio::task::block_in_place(|| stop_process(stopped));
    let held = {
        let client = client.clone();
        let j = slow.0.clone();
        tokio::spawn(async move { client.append(&req(&j), &b"held;"[..]).await })
    };
    // Several appends to the other journal, while the first waits.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for k in 0..5 {
        let bytes = format!("fast-{k};");
        let fast_req = req(&fast.0);
        let append = client.append(&fast_req, bytes.as_bytes().to_vec());
        let r = tokio::time::timeout(WAIT, append)
            .await
            .unwrap_or_else(|_| panic!("the append to {} waits behind {}'s", fast.0, slow.0))
            .unwrap_or_else(|e| panic!("append to {} while {} is stopped: {e}", fast.0, slow.1[1]));
        assert_eq!(r.sha1, sha1(bytes.as_bytes()));
    }
    assert!(
        !held.is_finished(),
        "the append to {} did not wait for its replica",
        slow.0
    );
    // The primary measures the stopped replica's lag (once a second): the
    // held append, committed here and not acknowledged.
    wait_replica_lag(&client, b"held;".len() as u64).await;

    continue_process(stopped);
    let r = held
        .await
        .unwrap()
        .expect("the held append, once its replica runs");
    assert_eq!(r.sha1, sha1(b"held;"));
    wait_replica_lag(&client, 0).await;
    for m in &slow.1 {
        let c = cluster.by_id(m).pinned().await;
        let (got, _) = read_local(&c, &slow.0, r.begin, Some(r.end)).await.unwrap();
        assert_eq!(got, b"held;", "{m}");
    }
}

/// Waits until the broker's STATS report a replica lag of `bytes`.
async fn wait_replica_lag(client: &Client, bytes: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let lag = client.stats().await.unwrap()["replica_lag_bytes"]
            .as_u64()
            .unwrap();
        if lag == bytes {
            return;
        }
        assert!(Instant::now() < deadline, "replica lag {lag}, not {bytes}");
        tokio::time::sleep(POLL).await;
    }
}

// ---------------------------------------------------------------------------
// 5. Brokers outside a route proxy to it, unless asked not to.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_outside_the_route_proxy_or_refuse() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        brokers_outside_the_route_proxy_or_refuse_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn brokers_outside_the_route_proxy_or_refuse_body(cluster: &mut Cluster) {
    let j = "repl/proxy";
    cluster.apply(&[spec(j, 2)]).await;
    let route = agreed_route(cluster, j).await;
    assert_eq!(route.members.len(), 2, "{route:?}");
    let members = ids(&route);
    let outside = cluster
        .brokers
        .iter()
        .find(|b| !members.contains(&b.id))
        .expect("a broker outside the route");
    let primary = cluster.by_id(&members[0]);
    let replica = cluster.by_id(&members[1]);
    let r = route_at(outside, j).await;
    assert_eq!(r.broker, outside.id);
    assert_eq!(ids(&r), members);

    // The outside broker proxies an append to the primary...
    let via_outside = outside.pinned().await;
    let first = b"appended through a broker outside the route".to_vec();
    let a = via_outside.append(&req(j), first.clone()).await.unwrap();
    assert_eq!((a.begin, a.end), (0, first.len() as u64));
    assert_eq!(a.sha1, sha1(&first));
    // ...and a read to a member.
    let (bytes, done) = read_range(&via_outside, j, 0, None).await.unwrap();
    assert_eq!(done.status, Status::OK, "{done:?}");
    assert_eq!(bytes, first);
    let mut expected = first;

    // A replica proxies appends to the primary too.
    let via_replica = replica.pinned().await;
    let second = b"; appended through the replica".to_vec();
    let a = via_replica.append(&req(j), second.clone()).await.unwrap();
    assert_eq!(
        (a.begin, a.end),
        (
            expected.len() as u64,
            (expected.len() + second.len()) as u64
        )
    );
    expected.extend_from_slice(&second);
    for b in [primary, replica] {
        assert_eq!(local_copy(b, j).await, expected, "{}", b.id);
    }
    let (bytes, _) = read_range(&via_outside, j, 0, None).await.unwrap();
    assert_eq!(bytes, expected, "proxied read from outside the route");

    // Asked not to proxy, the outside broker refuses a read...
    let (status, done) = match read_local(&via_outside, j, 0, None).await {
        Ok((bytes, done)) => {
            assert!(
                bytes.is_empty(),
                "{} bytes from outside the route",
                bytes.len()
            );
            (done.status, Some(done))
        }
        Err(e) => (e.status().unwrap_or_else(|| panic!("{e}")), None),
    };
    assert_eq!(status, Status::NOT_JOURNAL_BROKER, "{done:?}");
    // ...and so does it a read another broker proxied (PROXIED): a read is
    // proxied at most once, whatever the brokers' views of the route.
    let proxied_read = |to: &str| {
        let read = ReadRequest {
            journal: j.to_string(),
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        };
        let mut s = raw_connect(to);
        s.write_all(&frame(Op::READ, flag::PROXIED, 9, &read.encode(), &[]))
            .unwrap();
        let mut data = Vec::new();
        loop {
            let f = read_raw_frame(&mut s).unwrap().expect("a reply");
            assert_eq!(f.request_id, 9);
            match f.op {
                Op::READ_DATA => data.extend_from_slice(&f.payload),
                Op::READ_DONE => return (Status::from_code(f.status), data),
                other => panic!("{other:?}"),
            }
        }
    };
    let r = route_at(outside, j).await;
    let (status, data) = proxied_read(&r.local_endpoint);
    assert_eq!(status, Some(Status::NOT_JOURNAL_BROKER));
    assert!(data.is_empty());
    // A member serves it from its own copy.
    let r = route_at(replica, j).await;
    assert_eq!(
        proxied_read(&r.local_endpoint),
        (Some(Status::OK), expected.clone())
    );
    // ...and it and the replica refuse appends; the primary takes one.
    let no_proxy = AppendOptions { do_not_proxy: true };
    for (who, client) in [(&outside.id, &via_outside), (&replica.id, &via_replica)] {
        let r = client
            .append_with(&req(j), b"refused".to_vec(), no_proxy)
            .await;
        assert_eq!(
            status_of(r),
            Status::NOT_JOURNAL_PRIMARY_BROKER,
            "append with do_not_proxy on {who}"
        );
    }
    let third = b"; appended at the primary".to_vec();
    let a = primary
        .pinned()
        .await
        .append_with(&req(j), third.clone(), no_proxy)
        .await
        .unwrap();
    assert_eq!(a.begin, expected.len() as u64);
    expected.extend_from_slice(&third);
    for b in [primary, replica] {
        assert_eq!(local_copy(b, j).await, expected, "{}", b.id);
    }

    // `rotary read --pin` reads a member's own copy, and refuses elsewhere.
    for b in [primary, replica] {
        let (code, out, err) = run_cli(b.cli(&["read", j, "--pin"]), b"");
        assert_eq!(code, 0, "{}: {err}", b.id);
        assert_eq!(out, expected, "{}: rotary read --pin", b.id);
    }
    let (code, _, err) = run_cli(outside.cli(&["read", j, "--pin"]), b"");
    assert_ne!(code, 0, "read --pin on {} outside the route", outside.id);
    assert!(err.contains("NOT_JOURNAL_BROKER"), "{err}");

    // LIST on every broker and the CLI show the route.
    for b in &cluster.brokers {
        let list = b.client().await.list("").await.unwrap();
        let e = list.iter().find(|e| e.spec.name == j).expect("listed");
        assert_eq!(e.route.primary, members[0], "{}: {e:?}", b.id);
        assert_eq!(e.route.members, members, "{}: {e:?}", b.id);

        let (code, out, err) = run_cli(b.cli(&["journals", "list", "-o", "json"]), b"");
        assert_eq!(code, 0, "{err}");
        let entries: Vec<serde_json::Value> = serde_json::from_slice(&out).unwrap();
        let e = entries
            .iter()
            .find(|e| e["spec"]["name"] == j)
            .unwrap_or_else(|| panic!("{}: not in {entries:?}", b.id));
        assert_eq!(e["route"]["primary"], members[0].as_str(), "{e}");
        assert_eq!(e["route"]["members"], serde_json::json!(members), "{e}");

        let (code, out, err) = run_cli(b.cli(&["journals", "list"]), b"");
        assert_eq!(code, 0, "{err}");
        let table = String::from_utf8(out).unwrap();
        let line = table
            .lines()
            .find(|l| l.contains(j))
            .unwrap_or_else(|| panic!("{table}"));
        for m in &members {
            assert!(line.contains(m.as_str()), "{m} not in {line:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// 6. Fewer brokers than the replication factor.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_brokers_refuse_appends() {
    let mut cluster = Cluster::start(2, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        too_few_brokers_refuse_appends_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn too_few_brokers_refuse_appends_body(cluster: &mut Cluster) {
    let (short, fine) = ("repl/short", "repl/fine");
    cluster.apply(&[spec(short, 3), spec(fine, 2)]).await;

    for b in &cluster.brokers {
        for client in [b.client().await, b.pinned().await] {
            let r = client.append(&req(short), b"no".to_vec()).await;
            assert_eq!(
                status_of(r),
                Status::INSUFFICIENT_JOURNAL_BROKERS,
                "append to a journal of replication 3 on {}",
                b.id
            );
        }
    }
    // Nothing of the refused appends is anywhere (a broker may refuse the
    // read as well while the route is short).
    for b in &cluster.brokers {
        let pinned = b.pinned().await;
        match read_local(&pinned, short, 0, None).await {
            Ok((bytes, done)) => {
                assert!(bytes.is_empty(), "{}: {} bytes", b.id, bytes.len());
                assert!(
                    matches!(
                        done.status,
                        Status::OFFSET_NOT_YET_AVAILABLE | Status::INSUFFICIENT_JOURNAL_BROKERS
                    ),
                    "{}: {done:?}",
                    b.id
                );
                assert_eq!(done.write_head, 0, "{}: {done:?}", b.id);
            }
            Err(e) => assert_eq!(
                e.status(),
                Some(Status::INSUFFICIENT_JOURNAL_BROKERS),
                "{}: {e}",
                b.id
            ),
        }
    }

    // A journal the cluster can hold takes appends, on both brokers.
    let r = cluster.brokers[1]
        .client()
        .await
        .append(&req(fine), b"two copies".to_vec())
        .await
        .unwrap();
    assert_eq!((r.begin, r.end), (0, 10));
    for b in &cluster.brokers {
        assert_eq!(local_copy(b, fine).await, b"two copies", "{}", b.id);
    }
}

/// A broker that is down fails the SYNC of every journal it replicates,
/// and each primary says so in its log once per replica set, not once per
/// journal (a broker of tens of thousands of journals would write as many
/// lines a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_down_is_logged_once_per_replica_set() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_replica_down_is_logged_once_per_replica_set_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn a_replica_down_is_logged_once_per_replica_set_body(cluster: &mut Cluster) {
    const JOURNALS: usize = 18;
    const LOGGED: &str = "replicas did not synchronize";
    let names: Vec<String> = (0..JOURNALS)
        .map(|i| format!("repl/quiet-{i:02}"))
        .collect();
    let specs: Vec<JournalSpec> = names.iter().map(|n| spec(n, 3)).collect();
    cluster.apply(&specs).await;
    let mut primaries = Vec::new();
    for n in &names {
        let route = agreed_route(cluster, n).await;
        let primary = cluster.index(&route.members[0].id);
        append_retrying(&cluster.brokers[primary].pinned().await, n, b"up").await;
        primaries.push(primary);
    }
    let victim = 2;
    let down = cluster.brokers[victim].id.clone();
    tokio::task::block_in_place(|| cluster.brokers[victim].kill9());

    // Each journal the survivors lead fails its SYNC with the victim: its
    // appends are refused naming the refused connection.
    let refused = format!("replica {down} at");
    let mut led = [0usize; 3];
    for (n, &primary) in names.iter().zip(&primaries) {
        if primary == victim {
            continue;
        }
        led[primary] += 1;
        let client = cluster.brokers[primary].pinned().await;
        let deadline = Instant::now() + WAIT;
        loop {
            let err = client
                .append(&req(n), b"down".to_vec())
                .await
                .expect_err("a replica is down");
            if err.to_string().contains(&refused) {
                assert_eq!(err.status(), Some(Status::REPLICATION_FAILED), "{err}");
                break;
            }
            assert!(Instant::now() < deadline, "{n}: {err}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(led[0] + led[1] >= 2, "the survivors lead {led:?} journals");
    for (b, &led) in led.iter().enumerate().take(2) {
        let log = cluster.brokers[b].log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(LOGGED)).collect();
        assert!(
            lines.len() <= CORES,
            "{}: {} journals failed their SYNC with {down}, logged {} times:\n{}",
            cluster.brokers[b].id,
            led,
            lines.len(),
            lines.join("\n")
        );
        if led > 0 {
            assert!(
                !lines.is_empty(),
                "{}: nothing logged",
                cluster.brokers[b].id
            );
        }
    }
}

// ---------------------------------------------------------------------------
// 7. The cluster file changes while the brokers run.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_the_cluster_file() {
    let mut cluster = Cluster::start_listed(3, CORES, &[0, 1]);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        routes_follow_the_cluster_file_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Journals of the route-change test: enough that the new broker becomes
/// the primary of some and a replica of others.
const MOVING_JOURNALS: usize = 6;

async fn routes_follow_the_cluster_file_body(cluster: &mut Cluster) {
    let names: Vec<String> = (0..MOVING_JOURNALS)
        .map(|i| format!("repl/moving-{i}"))
        .collect();
    let specs: Vec<JournalSpec> = names.iter().map(|j| spec(j, 2)).collect();
    cluster.apply(&specs).await;

    // Before: every journal lives on b1 and b2.
    let client = cluster.brokers[0].client().await;
    let mut before = Vec::new();
    for (k, j) in names.iter().enumerate() {
        let route = agreed_route(cluster, j).await;
        let mut members = ids(&route);
        members.sort();
        assert_eq!(members, ["b1", "b2"], "{route:?}");
        let mut bytes = Vec::new();
        for seq in 0..10 {
            let c = record(k as u32, seq, 1000 + 37 * seq as usize);
            let r = client.append(&req(j), c.clone()).await.unwrap();
            assert_eq!(r.begin, bytes.len() as u64, "{j}");
            bytes.extend_from_slice(&c);
        }
        for b in &cluster.brokers[..2] {
            assert_eq!(local_copy(b, j).await, bytes, "{}: {j}", b.id);
        }
        before.push(bytes);
    }

    // b3 replaces b2.
    cluster.write_file(&[0, 2]);
    tokio::task::block_in_place(|| cluster.brokers[2].start());
    let deadline = Instant::now() + WAIT;
    for j in &names {
        loop {
            let r = route_at(&cluster.brokers[0], j).await;
            let mut now = ids(&r);
            now.sort();
            if now == ["b1", "b3"] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "b1 still routes {j} to {now:?} {WAIT:?} after the cluster file changed"
            );
            tokio::time::sleep(POLL).await;
        }
    }
    // b3 started after the specs were applied: apply them again, which
    // reaches every broker the cluster file lists now.
    cluster.apply(&specs).await;
    let mut primaries = Vec::new();
    for j in &names {
        primaries.push(agreed_route(cluster, j).await.members[0].id.clone());
    }
    eprintln!("primaries after the change: {primaries:?}");
    assert!(
        primaries.iter().any(|p| p == "b3") && primaries.iter().any(|p| p == "b1"),
        "the journals should include some whose primary moved to b3 and some that stayed \
         on b1: {primaries:?}"
    );

    // After: appends succeed, never at an offset already used, and b3
    // holds them.
    let client = cluster.brokers[0].client().await;
    for (k, j) in names.iter().enumerate() {
        let old_head = before[k].len() as u64;
        let mut after = Vec::new();
        let mut after_begin = None;
        for seq in 0..10 {
            let c = record(100 + k as u32, seq, 500 + 91 * seq as usize);
            let r = append_retrying(&client, j, &c).await;
            let begin = *after_begin.get_or_insert(r.begin);
            assert!(
                begin >= old_head,
                "{j} (primary {}): offsets went backwards: an append after the change \
                 landed at {begin} < {old_head}",
                primaries[k]
            );
            assert_eq!(
                r.begin,
                begin + after.len() as u64,
                "{j}: appends after the change"
            );
            after.extend_from_slice(&c);
        }
        let begin = after_begin.unwrap();
        let end = begin + after.len() as u64;
        for id in ["b3", "b1"] {
            let pinned = cluster.by_id(id).pinned().await;
            let (bytes, done) = read_local(&pinned, j, begin, Some(end))
                .await
                .unwrap_or_else(|e| panic!("{id}: {j}: read [{begin}, {end}): {e}"));
            assert_eq!(done.status, Status::OK, "{id}: {j}: {done:?}");
            assert!(
                bytes == after,
                "{id}: {j} (primary {}): [{begin}, {end}) holds {} bytes (SHA-1 {}), not the {} \
                 appended (SHA-1 {})",
                primaries[k],
                bytes.len(),
                hex_sha1(&bytes),
                after.len(),
                hex_sha1(&after)
            );
        }
        // b1 kept what it held before the change.
        let pinned = cluster.brokers[0].pinned().await;
        let (bytes, _) = read_local(&pinned, j, 0, Some(old_head)).await.unwrap();
        assert_eq!(bytes, before[k], "b1: {j} before the change");
    }
}

/// Three journals of one replica routed to b2 alone (names `prefix-N`
/// tried until three are), whose spools neither length nor time seals
/// during a test. Returns their names, and the specs of every name tried.
async fn open_on_b2(
    cluster: &Cluster,
    prefix: &str,
    store: Option<&TestStore>,
) -> (Vec<String>, Vec<JournalSpec>) {
    open_on_b2_where(cluster, prefix, store, |_| true).await
}

/// As [`open_on_b2`], of the names `keep` takes.
async fn open_on_b2_where(
    cluster: &Cluster,
    prefix: &str,
    store: Option<&TestStore>,
    keep: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<JournalSpec>) {
    let mut names = Vec::new();
    let mut specs = Vec::new();
    for i in 0..64 {
        let j = format!("{prefix}-{i}");
        if !keep(&j) {
            continue;
        }
        let mut s = match store {
            Some(store) => store_spec(&j, 1, store),
            None => spec(&j, 1),
        };
        s.fragment.length = 1 << 30;
        cluster.apply(std::slice::from_ref(&s)).await;
        specs.push(s);
        if ids(&agreed_route(cluster, &j).await) == ["b2"] {
            names.push(j);
            if names.len() == 3 {
                break;
            }
        }
    }
    assert_eq!(
        names.len(),
        3,
        "no three of 64 names taken and routed to b2 alone"
    );
    (names, specs)
}

/// Twenty records of many lengths appended through b1 to each journal, the
/// last setting the register `writer` to the journal's index. Returns the
/// bytes of each.
async fn write_open(cluster: &Cluster, names: &[String]) -> Vec<Vec<u8>> {
    let client = cluster.brokers[0].client().await;
    let mut written = Vec::new();
    for (k, j) in names.iter().enumerate() {
        let mut bytes = Vec::new();
        for seq in 0..20 {
            let c = record(k as u32, seq, 700 + 71 * seq as usize);
            let mut r = req(j);
            if seq == 19 {
                r.union_registers =
                    LabelSet::from_pairs([("writer", k.to_string().as_str())]).unwrap();
            }
            let a = client.append(&r, c.clone()).await.unwrap();
            assert_eq!(a.begin, bytes.len() as u64, "{j}");
            bytes.extend_from_slice(&c);
        }
        written.push(bytes);
    }
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_a_journal_moves_away_from_uploads_what_only_it_held() {
    let store = TestStore::file();
    let mut cluster = Cluster::start_listed(3, CORES, &[0, 1]);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_broker_a_journal_moves_away_from_uploads_what_only_it_held_body(&mut cluster, &store),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Journals with one replica on b2, which then leaves the cluster file: the
/// bytes are on b2 alone, in an open spool. b2 must seal and upload them,
/// though it is no longer any journal's primary.
async fn a_broker_a_journal_moves_away_from_uploads_what_only_it_held_body(
    cluster: &mut Cluster,
    store: &TestStore,
) {
    let (names, _) = open_on_b2(cluster, "repl/leaving", Some(store)).await;
    let written = write_open(cluster, &names).await;
    for j in &names {
        // Nothing in the store yet: the spool is open.
        assert!(
            store.fragments(j).is_empty(),
            "{j}: uploaded before the change"
        );
    }

    // b3 joins, then b2 leaves (a cluster file changes its brokers only
    // while every broker runs, so each one sees every change). b2 keeps
    // running, outside every route.
    cluster.write_file(&[0, 1, 2]);
    tokio::task::block_in_place(|| cluster.brokers[2].start());
    for j in &names {
        settled_route(cluster, j).await;
    }
    cluster.write_file(&[0, 2]);
    let deadline = Instant::now() + WAIT;
    for (j, bytes) in names.iter().zip(&written) {
        loop {
            let frags = store.fragments(j);
            let mut chained = Vec::new();
            for f in &frags {
                if f.begin == chained.len() as u64 {
                    chained.extend_from_slice(&f.bytes);
                }
            }
            if chained.len() >= bytes.len() {
                assert!(
                    chained[..bytes.len()] == bytes[..],
                    "{j}: the store holds other bytes (SHA-1 {}) than were appended (SHA-1 {})",
                    hex_sha1(&chained),
                    hex_sha1(bytes)
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{j}: the store holds {} of {} bytes {WAIT:?} after b2 left the route: {:?}",
                chained.len(),
                bytes.len(),
                frags.iter().map(|f| &f.key).collect::<Vec<_>>()
            );
            tokio::time::sleep(POLL).await;
        }
    }
    // b1 and b3 saw b2 leave. Either asks b2 for its head as it takes a
    // journal over and goes on from there.
    let client = cluster.brokers[0].client().await;
    for (j, bytes) in names.iter().zip(&written) {
        let primary = ids(&agreed_route(cluster, j).await).remove(0);
        let r = append_retrying(&client, j, b"after the move").await;
        assert_eq!(
            r.begin,
            bytes.len() as u64,
            "{j}: append after the move to {primary}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_routed_away_goes_on_from_the_head_of_the_broker_it_left() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_journal_routed_away_goes_on_from_the_head_of_the_broker_it_left_body(&mut cluster, None),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// As above, with a store that the broker left uploads to while the new
/// primary takes appends: these never reuse offsets of its uploads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_routed_away_goes_on_from_the_head_of_the_broker_it_left_while_it_uploads() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_journal_routed_away_goes_on_from_the_head_of_the_broker_it_left_body(
            &mut cluster,
            Some(&store),
        ),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Journals of one replica, written on b2 alone; then b2 leaves the
/// cluster file and keeps running, outside every route. The brokers the
/// journals move to saw b2 leave: before they give out an offset, they ask
/// b2 for its head and copy what it holds. Each journal goes on from where
/// it was, whole on its new primary, with its registers. Without that, the
/// first append after the move would be given offset 0 again (b2's bytes
/// out of every reader's reach, or, with a store, two histories in it
/// from offset 0 if the new primary listed it before b2's upload).
async fn a_journal_routed_away_goes_on_from_the_head_of_the_broker_it_left_body(
    cluster: &mut Cluster,
    store: Option<&TestStore>,
) {
    let (names, _) = open_on_b2(cluster, "repl/handed-over", store).await;
    let written = write_open(cluster, &names).await;

    // b2 leaves. Until b1 and b3 both route each journal elsewhere, the
    // appends below may be refused (retryably) or proxied to b2.
    cluster.write_file(&[0, 2]);
    wait_routed(cluster, &names, Some(2), &["b1", "b3"]).await;
    goes_on_where_it_was(cluster, &names, &written, store.is_none()).await;
    let Some(store) = store else {
        return;
    };
    // What b2 uploaded, and the new primaries their copies, is one history.
    let deadline = Instant::now() + WAIT;
    for (j, bytes) in names.iter().zip(&written) {
        loop {
            let frags = store.fragments(j);
            for f in &frags {
                let b = f.begin as usize;
                assert!(
                    f.end as usize <= bytes.len() && f.bytes[..] == bytes[b..f.end as usize],
                    "{j}: the store's [{}, {}) differs from what was appended there",
                    f.begin,
                    f.end
                );
            }
            let mut chained = 0;
            for f in &frags {
                if f.begin <= chained {
                    chained = chained.max(f.end);
                }
            }
            if chained == bytes.len() as u64 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{j}: the store chains {chained} of {} bytes: {:?}",
                bytes.len(),
                frags.iter().map(|f| &f.key).collect::<Vec<_>>()
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Appends to each journal through b1 after it moved, and checks that the
/// append lands at the head the journal had (`written` is what it holds),
/// with its registers, and that the new primary reads the whole journal
/// (with DO_NOT_PROXY when `do_not_proxy`; else what it listed in the store
/// may be read from there). Returns the brokers the journals moved to.
async fn goes_on_where_it_was(
    cluster: &Cluster,
    names: &[String],
    written: &[Vec<u8>],
    do_not_proxy: bool,
) -> HashSet<String> {
    let client = cluster.brokers[0].client().await;
    let mut moved_to = HashSet::new();
    for (k, (j, bytes)) in names.iter().zip(written).enumerate() {
        let primary = ids(&agreed_route(cluster, j).await).remove(0);
        let r = append_retrying(&client, j, b"after the move").await;
        assert_eq!(
            r.begin,
            bytes.len() as u64,
            "{j}: the first append on {primary} after the move"
        );
        assert_eq!(
            r.registers,
            LabelSet::from_pairs([("writer", k.to_string().as_str())]).unwrap(),
            "{j}: registers on {primary} after the move"
        );
        let mut want = bytes.clone();
        want.extend_from_slice(b"after the move");
        // The new primary holds it all itself (or, what it listed in the
        // store already, reads it from there).
        let at = cluster.brokers.iter().find(|b| b.id == primary).unwrap();
        let (got, done) = read_range_with(
            &at.client().await,
            j,
            0,
            None,
            ReadOptions {
                do_not_proxy,
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{j}: read on {primary}: {e}"));
        assert_eq!(done.write_head, want.len() as u64, "{j}: {done:?}");
        assert!(
            got == want,
            "{j}: {primary} reads {} bytes (SHA-1 {}), {} were appended (SHA-1 {})",
            got.len(),
            hex_sha1(&got),
            want.len(),
            hex_sha1(&want)
        );
        moved_to.insert(primary);
    }
    eprintln!("journals moved to {moved_to:?}");
    moved_to
}

/// Until b1 (and `also`, when running) routes each of `names` to a
/// broker in `to`.
async fn wait_routed(cluster: &Cluster, names: &[String], also: Option<usize>, to: &[&str]) {
    let deadline = Instant::now() + WAIT;
    for j in names {
        loop {
            let at1 = ids(&route_at(&cluster.brokers[0], j).await);
            let other = match also {
                Some(i) => ids(&route_at(&cluster.brokers[i], j).await),
                None => at1.clone(),
            };
            if at1 == other && at1.len() == 1 && to.contains(&at1[0].as_str()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{j}: b1 routes it to {at1:?}, the other to {other:?}, not one of {to:?}"
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_moved_twice_before_a_request_goes_on_from_where_it_was() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_journal_moved_twice_before_a_request_goes_on_from_where_it_was_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Journals of one replica written on b2 alone. b2 leaves the cluster file,
/// and then b3 does too, both still running, before any request reaches a
/// journal: b1 is the primary of all of them. The view before b1's
/// current one has no route through b2, yet b1 asks b2 (a broker of the
/// view before that), since it has not asked about either change, and each
/// journal goes on from b2's head.
async fn a_journal_moved_twice_before_a_request_goes_on_from_where_it_was_body(
    cluster: &mut Cluster,
) {
    let (names, _) = open_on_b2(cluster, "repl/moved-twice", None).await;
    let written = write_open(cluster, &names).await;
    cluster.write_file(&[0, 2]);
    wait_routed(cluster, &names, Some(2), &["b1", "b3"]).await;
    cluster.write_file(&[0]);
    wait_routed(cluster, &names, None, &["b1"]).await;
    let moved_to = goes_on_where_it_was(cluster, &names, &written, true).await;
    assert_eq!(moved_to, HashSet::from(["b1".to_string()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_routed_away_is_taken_over_without_a_request() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_journal_routed_away_is_taken_over_without_a_request_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Journals of one replica written on b2 alone; b2 leaves the cluster file
/// and keeps running. No request reaches the journals, yet their new
/// primaries take them over, copying b2's bytes. Once they hold them all,
/// b2 is killed, and every journal still goes on from where it was, its
/// bytes whole on its new primary.
async fn a_journal_routed_away_is_taken_over_without_a_request_body(cluster: &mut Cluster) {
    let (names, _) = open_on_b2(cluster, "repl/taken-over-unasked", None).await;
    let written = write_open(cluster, &names).await;
    let total: u64 = written.iter().map(|w| w.len() as u64).sum();
    // A counter of STATS summed over b1 and b3.
    async fn counted(cluster: &Cluster, counter: &str) -> u64 {
        let mut sum = 0;
        for b in [&cluster.brokers[0], &cluster.brokers[2]] {
            let stats = b.client().await.stats().await.unwrap();
            sum += stats[counter].as_u64().expect(counter);
        }
        sum
    }
    assert_eq!(counted(cluster, "copied_bytes").await, 0);
    let syncs = counted(cluster, "syncs").await;
    cluster.write_file(&[0, 2]);
    let deadline = Instant::now() + WAIT;
    loop {
        let now = counted(cluster, "copied_bytes").await;
        if now == total {
            break;
        }
        assert!(
            now < total && Instant::now() < deadline,
            "b1 and b3 copied {now} bytes of the {total} b2 held"
        );
        tokio::time::sleep(POLL).await;
    }
    tokio::task::block_in_place(|| cluster.brokers[1].kill9());
    wait_routed(cluster, &names, Some(2), &["b1", "b3"]).await;
    goes_on_where_it_was(cluster, &names, &written, true).await;
    // Only the journals that moved were taken over: the others open_on_b2
    // made, which b1 or b3 was the primary of before, cost no SYNC.
    assert_eq!(
        counted(cluster, "syncs").await - syncs,
        names.len() as u64,
        "SYNCs of b1 and b3 after the change"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_broker_a_journal_left_is_waited_for_once() {
    takeovers_past_a_stopped_broker(false).await;
}

/// As [`a_stopped_broker_a_journal_left_is_waited_for_once`], with b2
/// keeping its data: its spools are open again at its start, and still no
/// append is staged until the journal's takeover has asked b3 (or passed
/// it over), so each goes on from b2's own head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_kept_its_data_takes_no_append_before_its_takeover() {
    takeovers_past_a_stopped_broker(true).await;
}

async fn takeovers_past_a_stopped_broker(keep_data: bool) {
    let mut cluster = tokio::task::block_in_place(start_with_short_ack_timeout);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_stopped_broker_a_journal_left_is_waited_for_once_body(&mut cluster, keep_data),
    )
    .await;
    if let Some(pid) = cluster.brokers[2].pid() {
        continue_process(pid);
    }
    cluster.finished(done, TEST_LIMIT);
}

/// Journals of one replica written on b2 alone. b2 is killed (and, unless
/// `keep_data`, loses its data), and b3 is stopped (SIGSTOP) without
/// exiting, so connections to it
/// open but nothing is answered; then b2 starts again. A broker that starts
/// assumes it just joined its cluster, so it asks the other brokers for
/// their heads of each journal it leads, at the journal's first request,
/// one journal after another: it waits one ack timeout for b3 at the
/// first, then passes b3 over for the others rather than wait for it again
/// at each. Without its data b2's bytes are gone: the journals begin
/// again at 0.
async fn a_stopped_broker_a_journal_left_is_waited_for_once_body(
    cluster: &mut Cluster,
    keep_data: bool,
) {
    // Names that b2, were it not in the cluster, would have on b3: those
    // b2 asks b3 about as it starts.
    let others = rotary_engine::topology::ClusterView {
        me: "b2".into(),
        brokers: [0, 2]
            .map(|i| {
                let b = &cluster.brokers[i];
                rotary_engine::topology::Member {
                    id: b.id.clone(),
                    zone: b.zone.clone(),
                    endpoint: b.endpoint().parse().unwrap(),
                    shards: None,
                }
            })
            .to_vec(),
        assigned: None,
    };
    let left_to_b3 = |j: &str| others.route(j, 1).is_primary("b3");
    let (names, _) = open_on_b2_where(cluster, "repl/stopped-left", None, left_to_b3).await;
    let written = write_open(cluster, &names).await;
    tokio::task::block_in_place(|| cluster.brokers[1].kill9());
    if !keep_data {
        std::fs::remove_dir_all(&cluster.brokers[1].data).unwrap();
    }
    let b3 = cluster.brokers[2].pid().expect("b3 runs");
    tokio::task::block_in_place(|| stop_process(b3));
    tokio::task::block_in_place(|| cluster.brokers[1].start());
    let client = cluster.brokers[1].client().await;
    for (j, bytes) in names.iter().zip(&written) {
        let r = append_retrying(&client, j, b"after the start").await;
        let head = if keep_data { bytes.len() as u64 } else { 0 };
        assert_eq!(
            r.begin, head,
            "{j}: b2's own head (b3 never had the journal)"
        );
    }
    let stats = client.stats().await.unwrap();
    let counted = (
        stats["takeover_sources_silent"].as_u64().unwrap(),
        stats["takeover_sources_passed_over"].as_u64().unwrap(),
    );
    let n = names.len() as u64;
    assert_eq!(
        counted,
        (1, n - 1),
        "b2 took over {n} journal(s) while b3 was stopped: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_outside_a_route_do_not_list_its_stores() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        brokers_outside_a_route_do_not_list_its_stores_body(&mut cluster, &store),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// Rep-1 journals with stores, all routed to b1. b2 and b3 restart, and so
/// hold every journal of their spec stores; they only proxy these, so they
/// let the stores' index go rather than list it every `refresh_interval`.
/// They still answer FRAGMENTS as b1 does, listing once for it. When b1
/// stops and leaves the cluster file, the broker that takes each journal
/// lists its store before the first append, and so refuses to reuse the
/// offsets b1 wrote.
async fn brokers_outside_a_route_do_not_list_its_stores_body(
    cluster: &mut Cluster,
    store: &TestStore,
) {
    // Names tried without stores (no broker lists those) until three are
    // routed to b1 alone; only those three get the store.
    let mut names = Vec::new();
    for i in 0..64 {
        let j = format!("repl/listed-by-b1-{i}");
        cluster.apply(&[spec(&j, 1)]).await;
        if ids(&agreed_route(cluster, &j).await) == ["b1"] {
            names.push(j);
            if names.len() == 3 {
                break;
            }
        }
    }
    assert_eq!(names.len(), 3, "no three of 64 names routed to b1 alone");
    let specs: Vec<JournalSpec> = names.iter().map(|j| store_spec(j, 1, store)).collect();
    cluster.apply(&specs).await;
    let client = cluster.brokers[0].client().await;
    let mut written = Vec::new();
    for (k, j) in names.iter().enumerate() {
        let mut bytes = Vec::new();
        for seq in 0..5 {
            let c = record(k as u32, seq, 900 + 37 * seq as usize);
            let r = append_retrying(&client, j, &c).await;
            assert_eq!(r.begin, bytes.len() as u64, "{j}");
            bytes.extend_from_slice(&c);
        }
        client.seal(j).await.unwrap();
        written.push(bytes);
    }
    let deadline = Instant::now() + WAIT;
    for (j, bytes) in names.iter().zip(&written) {
        while !store_covers(&client.fragments(j).await.unwrap(), bytes.len() as u64) {
            assert!(Instant::now() < deadline, "{j}: never uploaded");
            tokio::time::sleep(POLL).await;
        }
    }

    // A rolling restart of the other brokers: each starts with every
    // journal it knows.
    tokio::task::block_in_place(|| {
        for b in &mut cluster.brokers[1..] {
            b.kill9();
            b.start();
        }
    });

    let counter = |stats: &serde_json::Value, k: &str| {
        stats[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {stats}"))
    };
    let stats_of = |i: usize| {
        let b = &cluster.brokers[i];
        async move { b.pinned().await.stats().await.unwrap() }
    };
    // Each journal's refresh came due on b2 and b3 and was spared.
    let deadline = Instant::now() + WAIT;
    for i in [1, 2] {
        loop {
            let stats = stats_of(i).await;
            if counter(&stats, "listings_spared") >= 3 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "b{}: not three refreshes spared: {stats}",
                i + 1
            );
            tokio::time::sleep(POLL).await;
        }
    }
    let before: Vec<serde_json::Value> =
        [stats_of(0).await, stats_of(1).await, stats_of(2).await].into();
    // Three refresh intervals of the journals.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let after: Vec<serde_json::Value> =
        [stats_of(0).await, stats_of(1).await, stats_of(2).await].into();
    let listed = |i: usize| counter(&after[i], "listings") - counter(&before[i], "listings");
    let spared =
        |i: usize| counter(&after[i], "listings_spared") - counter(&before[i], "listings_spared");
    assert!(
        listed(0) >= 3,
        "b1, the journals' broker, listed {} times",
        listed(0)
    );
    assert_eq!(spared(0), 0, "b1 spared its own journals' listings");
    for i in [1, 2] {
        assert_eq!(
            listed(i),
            0,
            "b{} listed the stores of journals it proxies",
            i + 1
        );
        assert!(spared(i) >= 3, "b{} spared {} refreshes", i + 1, spared(i));
    }

    // FRAGMENTS of b2, outside the route, lists the store at once for it.
    let stored = |frags: Vec<rotary_net::client::FragmentInfo>| {
        let mut v: Vec<(u64, u64, String)> = frags
            .into_iter()
            .filter(|f| f.store != "local")
            .map(|f| (f.begin, f.end, f.sha1))
            .collect();
        v.sort();
        v
    };
    let b1 = cluster.brokers[0].pinned().await;
    let b2 = cluster.brokers[1].pinned().await;
    for (j, bytes) in names.iter().zip(&written) {
        let of_b1 = stored(b1.fragments(j).await.unwrap());
        assert_eq!(of_b1.last().map(|f| f.1), Some(bytes.len() as u64), "{j}");
        assert_eq!(
            stored(b2.fragments(j).await.unwrap()),
            of_b1,
            "{j}: b2's FRAGMENTS"
        );
    }
    assert!(counter(&stats_of(1).await, "listings_hurried") >= 3);

    // b1 stops, its bytes all in the store, and leaves the cluster file.
    // Whoever takes a journal cannot ask b1 for its head, and lists the
    // store before appending: it finds b1's history beyond its own head
    // and refuses the offsets.
    cluster.brokers[0].kill9();
    cluster.write_file(&[1, 2]);
    let deadline = Instant::now() + WAIT;
    for j in &names {
        for b in &cluster.brokers[1..] {
            loop {
                let now = ids(&route_at(b, j).await);
                if !now.is_empty() && !now.iter().any(|id| id == "b1") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{} still routes {j} to {now:?} {WAIT:?} after b1 left",
                    b.id
                );
                tokio::time::sleep(POLL).await;
            }
        }
    }
    let client = cluster.brokers[1].client().await;
    for (j, bytes) in names.iter().zip(&written) {
        let deadline = Instant::now() + WAIT;
        loop {
            match client.append(&req(j), b"too early".to_vec()).await {
                Err(e) if e.status() == Some(Status::INDEX_HAS_GREATER_OFFSET) => break,
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(POLL).await;
                }
                other => panic!("{j}: append after b1 left: {other:?}"),
            }
        }
        let head = client.reset_head(j).await.unwrap();
        assert_eq!(head, bytes.len() as u64, "{j}: head after reset-head");
        let tail = b"after b1 left";
        let r = append_retrying(&client, j, tail).await;
        assert_eq!(r.begin, bytes.len() as u64, "{j}: append after reset-head");
        let primary = agreed_route(cluster, j).await.members[0].id.clone();
        assert_ne!(primary, "b1");
        let mut expect = bytes.clone();
        expect.extend_from_slice(tail);
        let copy = direct_copy(cluster.by_id(&primary), j).await;
        assert!(
            copy == expect,
            "{j}: {} read back, SHA-1 {}, expected {}",
            copy.len(),
            hex_sha1(&copy),
            hex_sha1(&expect)
        );
    }
}

/// A broker that was down while journals were created learns them from its
/// peers when it starts again: it lists them, proxies or serves appends and
/// reads, and does not answer JOURNAL_NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_lost_its_data_copies_the_history_from_a_replica() {
    let store = TestStore::file();
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_primary_that_lost_its_data_copies_the_history_from_a_replica_body(&mut cluster, &store),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// The primary of two journals (one without a store, one with small
/// fragments in a store) is killed and starts again on an empty data
/// directory, as after a replaced disk. Its replicas are ahead of it. It
/// must not take appends until it holds what they hold: it then serves the
/// whole history itself, uploads what the store lacked, and appends follow
/// the history at the next offset.
async fn a_primary_that_lost_its_data_copies_the_history_from_a_replica_body(
    cluster: &mut Cluster,
    store: &TestStore,
) {
    const PLAIN: &str = "repl/lost-data";
    cluster.apply(&[spec(PLAIN, 3)]).await;
    let primary_id = agreed_route(cluster, PLAIN).await.members[0].id.clone();
    // A journal with a store and the same primary (names tried in turn).
    let mut stored = None;
    for i in 0..32 {
        let j = format!("repl/lost-data-stored-{i}");
        let mut s = store_spec(&j, 3, store);
        s.fragment.length = 64 << 10;
        cluster.apply(std::slice::from_ref(&s)).await;
        if agreed_route(cluster, &j).await.members[0].id == primary_id {
            stored = Some(j);
            break;
        }
    }
    let stored = stored.expect("one of 32 names has the same primary");
    let journals = [PLAIN.to_string(), stored.clone()];
    let primary = cluster.index(&primary_id);

    let client = cluster.brokers[primary].client().await;
    let mut written = [Vec::new(), Vec::new()];
    for seq in 0..40 {
        for (k, j) in journals.iter().enumerate() {
            let c = record(k as u32, seq, 1500 + 97 * seq as usize);
            let r = append_retrying(&client, j, &c).await;
            assert_eq!(r.begin, written[k].len() as u64, "{j}");
            written[k].extend_from_slice(&c);
        }
    }
    drop(client);
    // Some of the stored journal is in the store, not all of it.
    let deadline = Instant::now() + WAIT;
    while store.fragments(&stored).is_empty() {
        assert!(Instant::now() < deadline, "{stored}: nothing uploaded");
        tokio::time::sleep(POLL).await;
    }

    tokio::task::block_in_place(|| {
        let b = &mut cluster.brokers[primary];
        b.kill9();
        std::fs::remove_dir_all(&b.data).unwrap();
        std::fs::create_dir_all(&b.data).unwrap();
        b.start();
    });
    let client = cluster.brokers[primary].client().await;
    for (k, j) in journals.iter().enumerate() {
        let tail = format!("after the restart of {primary_id}").into_bytes();
        let r = append_retrying(&client, j, &tail).await;
        assert_eq!(
            r.begin,
            written[k].len() as u64,
            "{j}: the first append after the restart"
        );
        written[k].extend_from_slice(&tail);
    }
    // The primary holds every byte itself (the store-held part of the
    // stored journal it serves from the store).
    let b = &cluster.brokers[primary];
    let plain = local_copy(b, PLAIN).await;
    assert!(
        plain == written[0],
        "{PLAIN}: {primary_id} holds {} bytes (SHA-1 {}), {} were appended (SHA-1 {})",
        plain.len(),
        hex_sha1(&plain),
        written[0].len(),
        hex_sha1(&written[0])
    );
    let copy = direct_copy(b, &stored).await;
    assert!(
        copy == written[1],
        "{stored}: {primary_id} serves {} bytes (SHA-1 {}), {} were appended (SHA-1 {})",
        copy.len(),
        hex_sha1(&copy),
        written[1].len(),
        hex_sha1(&written[1])
    );
    for other in cluster.listed().iter().filter(|&&i| i != primary) {
        let o = &cluster.brokers[*other];
        assert_eq!(
            local_copy(o, PLAIN).await,
            written[0],
            "{PLAIN} on {}",
            o.id
        );
    }
    // What the store lacked reaches it, uploaded by the primary: every
    // byte from before the restart is in the store once the spool seals.
    let before = written[1].len() - format!("after the restart of {primary_id}").len();
    let sealed = cluster.brokers[primary]
        .client()
        .await
        .seal(&stored)
        .await
        .unwrap();
    assert!(
        sealed.is_some(),
        "{stored}: the spool after the restart was empty"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        // Fragments may overlap: the copy may have started before the
        // store was listed, and then covers what the store held already.
        let mut frags = store.fragments(&stored);
        frags.sort_by_key(|f| f.begin);
        let mut chained = Vec::new();
        for f in frags {
            let at = chained.len() as u64;
            if f.begin <= at && f.end > at {
                chained.extend_from_slice(&f.bytes[(at - f.begin) as usize..]);
            }
        }
        if chained.len() >= written[1].len() {
            assert!(
                chained == written[1],
                "{stored}: the store holds other bytes (SHA-1 {}) than were appended (SHA-1 {})",
                hex_sha1(&chained),
                hex_sha1(&written[1])
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{stored}: the store chains {} bytes from 0 of {} ({before} before the restart) {WAIT:?} after the seal",
            chained.len(),
            written[1].len()
        );
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_lost_its_data_fills_its_copy_from_every_replica() {
    let mut cluster = Cluster::start(3, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_primary_that_lost_its_data_fills_its_copy_from_every_replica_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

/// The first replica lost its data earlier and holds only the newest
/// bytes; the second holds them all, at the same head. The primary, after
/// losing its own data, must take what the first lacks from the second.
/// And until it holds the history it does not answer reads as if the
/// journal were empty.
async fn a_primary_that_lost_its_data_fills_its_copy_from_every_replica_body(
    cluster: &mut Cluster,
) {
    const J: &str = "repl/lost-data-twice";
    cluster.apply(&[spec(J, 3)]).await;
    let route = agreed_route(cluster, J).await;
    let primary = cluster.index(&route.members[0].id);
    let first_replica = cluster.index(&route.members[1].id);
    let mut written = Vec::new();
    let append_some = |client: Client, n: u32, k: u32| {
        let mut out = Vec::new();
        async move {
            for seq in 0..n {
                let c = record(k, seq, 900 + 131 * seq as usize);
                let r = append_retrying(&client, J, &c).await;
                out.push((r.begin, c));
            }
            out
        }
    };
    for (begin, c) in append_some(cluster.brokers[primary].client().await, 30, 0).await {
        assert_eq!(begin, written.len() as u64);
        written.extend_from_slice(&c);
    }
    let wipe = |b: &mut ClusterBroker| {
        b.kill9();
        std::fs::remove_dir_all(&b.data).unwrap();
        std::fs::create_dir_all(&b.data).unwrap();
        b.start();
    };
    tokio::task::block_in_place(|| wipe(&mut cluster.brokers[first_replica]));
    for (begin, c) in append_some(cluster.brokers[primary].client().await, 5, 1).await {
        assert_eq!(begin, written.len() as u64);
        written.extend_from_slice(&c);
    }
    // The first replica holds the newest records only.
    let b = &cluster.brokers[first_replica];
    assert_eq!(local_head(b, J).await, written.len() as u64);

    tokio::task::block_in_place(|| wipe(&mut cluster.brokers[primary]));
    let b = &cluster.brokers[primary];
    // At once: the head of a journal it has no data of is not 0.
    assert_eq!(local_head(b, J).await, written.len() as u64, "{}", b.id);
    let copy = local_copy(b, J).await;
    assert!(
        copy == written,
        "{}: holds {} bytes (SHA-1 {}), {} were appended (SHA-1 {})",
        b.id,
        copy.len(),
        hex_sha1(&copy),
        written.len(),
        hex_sha1(&written)
    );
    let r = append_retrying(&b.client().await, J, b"after").await;
    assert_eq!(r.begin, written.len() as u64);
}

// ---------------------------------------------------------------------------
// A broker that proxies to a peer which stops answering answers what it
// proxied there IO_ERROR, and keeps serving its client otherwise.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_proxied_to_a_peer_that_stopped_answering_fail_with_io_error() {
    let mut cluster = Cluster::start_listed(2, CORES, &[]);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        requests_proxied_to_a_peer_that_stopped_answering_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn requests_proxied_to_a_peer_that_stopped_answering_body(cluster: &mut Cluster) {
    // Long enough that a PONG delayed by a loaded machine still counts.
    let silence = Duration::from_secs(1);
    tokio::task::block_in_place(|| {
        cluster.write_file(&[0, 1]);
        for b in &mut cluster.brokers {
            b.serve_args = vec!["--peer-silence".into(), "1s".into()];
            b.start();
        }
    });
    let j = "repl/silent-peer";
    cluster.apply(&[spec(j, 1)]).await;
    let route = agreed_route(cluster, j).await;
    let members = ids(&route);
    assert_eq!(members.len(), 1, "{route:?}");
    let primary = cluster.by_id(&members[0]);
    let outside = cluster
        .brokers
        .iter()
        .find(|b| b.id != members[0])
        .expect("a broker outside the route");
    let via_outside = outside.pinned().await;
    let first = b"before the stop".to_vec();
    let a = via_outside.append(&req(j), first.clone()).await.unwrap();
    assert_eq!((a.begin, a.end), (0, first.len() as u64));

    // A proxied tail at the head waits for four times the silence without
    // an error: the primary answers the proxy's PINGs.
    let at_head = ReadRequest {
        journal: j.into(),
        offset: Some(a.end),
        end_offset: None,
        route_revision: 0,
    };
    let mut tail = via_outside.read(&at_head, true, false).await.unwrap();
    let quiet = tokio::time::timeout(silence * 4, tail.next()).await;
    assert!(quiet.is_err(), "the proxied tail waits: {quiet:?}");

    // Stopped, the primary answers nothing: the proxied tail and an append
    // proxied after the stop are answered IO_ERROR by the outside broker.
    let pid = primary.pid().expect("primary running");
    stop_process(pid);
    let started = Instant::now();
    let never = req(j);
    let append = via_outside.append(&never, b"sent during the stop".to_vec());
    let (ev, appended) = tokio::time::timeout(WAIT, async { tokio::join!(tail.next(), append) })
        .await
        .expect("the proxy gives up on a stopped peer");
    let waited = started.elapsed();
    continue_process(pid);
    let e = appended.unwrap_err();
    assert_eq!(e.status(), Some(Status::IO_ERROR), "append: {e}");
    assert!(
        e.to_string().contains("not even an answer to a PING"),
        "{e}"
    );
    match ev {
        Some(Err(e)) => assert_eq!(e.status(), Some(Status::IO_ERROR), "tail: {e}"),
        other => panic!("tail: {other:?}"),
    }
    // A PING went out at most a tick (a quarter of the silence) after the
    // stop, and was left unanswered for the silence.
    assert!(waited >= silence * 3 / 4, "gave up after {waited:?}");
    // The client's connection to the proxy was kept, and serves.
    via_outside.ping().await.unwrap();

    // Running again, the primary takes proxied appends over a new relay.
    let last = b"; after the stop".to_vec();
    let b = via_outside.append(&req(j), last.clone()).await.unwrap();
    assert_eq!(b.end - b.begin, last.len() as u64);
    // The append sent during the stop reached the stopped primary's socket:
    // it may have committed once the primary ran again (its outcome is
    // unknown to the client, as the error says), but whole if at all.
    let got = local_copy(primary, j).await;
    let with: Vec<u8> = [&first[..], b"sent during the stop", &last[..]].concat();
    let without: Vec<u8> = [&first[..], &last[..]].concat();
    assert!(
        got == with || got == without,
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}

// ---------------------------------------------------------------------------
// A member whose disk fills (a replica, or the primary): appends are
// refused with a retryable status that names the full disk (and the
// replica), no member takes half of one, and appends go on by themselves
// once the member has space again.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_disk_fills_refuses_appends_until_it_has_space() {
    disk_fills(FullMember::Replica).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_whose_disk_fills_refuses_appends_until_it_has_space() {
    disk_fills(FullMember::Primary).await;
}

/// Which member of the journal's route runs out of disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FullMember {
    Primary,
    Replica,
}

async fn disk_fills(which: FullMember) {
    let store = TestStore::file();
    let mut cluster = Cluster::start_listed(3, CORES, &[]);
    // The last broker's data directory is a small tmpfs of its own.
    let full = 2;
    let Some(mount) = mount_tmpfs(&cluster.brokers[full].data, "24m") else {
        eprintln!("SKIPPED: mounting a tmpfs needs root");
        return;
    };
    tokio::task::block_in_place(|| {
        cluster.write_file(&[0, 1, 2]);
        for b in &mut cluster.brokers {
            b.start();
        }
    });
    let done = tokio::time::timeout(
        TEST_LIMIT,
        disk_fills_body(&mut cluster, &store, full, which, &mount),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn disk_fills_body(
    cluster: &mut Cluster,
    store: &TestStore,
    full: usize,
    which: FullMember,
    mount: &Mounted,
) {
    // A journal whose route has the full broker where `which` says.
    let full_id = cluster.brokers[full].id.clone();
    let mut chosen = None;
    for i in 0..32 {
        let name = format!("repl/{which:?}-full-{i}").to_lowercase();
        cluster.apply(&[store_spec(&name, 3, store)]).await;
        let route = agreed_route(cluster, &name).await;
        if (route.members[0].id == full_id) == (which == FullMember::Primary) {
            chosen = Some((name, route));
            break;
        }
    }
    let (j, route) = chosen.expect("a journal with the full broker in the wanted place");
    let primary = cluster.index(&route.members[0].id);
    let client = cluster.brokers[primary].client().await;
    // A full replica fails the primary's replication; a full primary
    // refuses the append itself.
    let (status, names) = match which {
        FullMember::Replica => (
            Status::REPLICATION_FAILED,
            vec![full_id.as_str(), "STORAGE_FULL"],
        ),
        FullMember::Primary => (Status::STORAGE_FULL, vec!["disk full"]),
    };

    // Appends of 256 KiB (several chunks each) until the disk refuses one.
    let warm = record(0, 0, 100);
    let mut acked_all = vec![acked(0, 0, &append_retrying(&client, &j, &warm).await)];
    let mut unknown = HashSet::new();
    let mut seq = 1;
    let refusal = loop {
        assert!(seq < 400, "24 MiB never filled");
        let content = record(0, seq, 256 << 10);
        match client.append(&req(&j), content).await {
            Ok(r) => acked_all.push(acked(0, seq, &r)),
            Err(e) => {
                unknown.insert((0, seq));
                break e;
            }
        }
        seq += 1;
    };
    seq += 1;
    assert_eq!(refusal.status(), Some(status), "{refusal}");
    assert!(refusal.is_retryable(), "{refusal}");
    let text = refusal.to_string();
    assert!(
        names.iter().all(|n| text.contains(n)),
        "the refusal does not name {names:?}: {text}"
    );

    // Still full: still refused the same way, and every member holds
    // whole records in one offset space.
    for _ in 0..3 {
        let e = client
            .append(&req(&j), record(0, seq, 4096))
            .await
            .expect_err("an append while the disk is full");
        assert_eq!(e.status(), Some(status), "{e}");
        unknown.insert((0, seq));
        seq += 1;
    }
    let p_copy = direct_copy(&cluster.brokers[primary], &j).await;
    parse_records(&p_copy, 0).unwrap_or_else(|e| panic!("primary: {e}"));
    for m in &route.members[1..] {
        let b = &cluster.brokers[cluster.index(&m.id)];
        let copy = direct_copy(b, &j).await;
        parse_records(&copy, 0).unwrap_or_else(|e| panic!("{}: {e}", b.id));
        assert_prefix_consistent(("primary", &p_copy), (&b.id, &copy));
    }

    // Space returns: appends go on without a restart.
    let grown = std::process::Command::new("mount")
        .args(["-o", "remount,size=256m"])
        .arg(&mount.0)
        .status()
        .expect("remount");
    assert!(grown.success());
    let content = record(0, seq, 4096);
    acked_all.push(acked(0, seq, &append_retrying(&client, &j, &content).await));
    seq += 1;
    for _ in 0..20 {
        let content = record(0, seq, 64 << 10);
        let r = client
            .append(&req(&j), content)
            .await
            .expect("appends once the replica has space");
        acked_all.push(acked(0, seq, &r));
        seq += 1;
    }

    // Every member reads the same journal (a span a full replica missed,
    // from the store), holding every acknowledged append.
    let head = local_head(&cluster.brokers[primary], &j).await;
    converged_through_the_store(cluster, primary, &j, head, &acked_all, &unknown).await;
}

// ---------------------------------------------------------------------------
// Primaries poll for their replicas' acks (`--ack-poll`), unless told not to.

/// Appends of 1 KiB to each journal in the ack-poll test.
const POLL_APPENDS: u32 = 40;

/// A name under `prefix` whose route (as `at` computes it) has `primary`
/// first.
async fn name_with_primary(at: &ClusterBroker, prefix: &str, primary: &str) -> String {
    for i in 0..256 {
        let name = format!("{prefix}-{i:03}");
        if ids(&route_at(at, &name).await)[0] == primary {
            return name;
        }
    }
    panic!("no name {prefix}-NNN has {primary} as its primary");
}

async fn stat(b: &ClusterBroker, name: &str) -> u64 {
    let stats = b.client().await.stats().await.expect("STATS");
    stats[name]
        .as_u64()
        .unwrap_or_else(|| panic!("{}: STATS has no {name}: {stats}", b.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primaries_poll_for_acks_unless_told_not_to() {
    // b1 keeps the default; b2 and b3 are started with `--ack-poll 0`.
    let mut cluster = tokio::task::block_in_place(|| {
        let mut cluster = Cluster::start_listed(3, CORES, &[]);
        cluster.write_file(&[0, 1, 2]);
        for (i, b) in cluster.brokers.iter_mut().enumerate() {
            if i > 0 {
                b.serve_args = vec!["--ack-poll".into(), "0".into()];
            }
            b.start();
        }
        cluster
    });
    let done = tokio::time::timeout(
        TEST_LIMIT,
        primaries_poll_for_acks_unless_told_not_to_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn primaries_poll_for_acks_unless_told_not_to_body(cluster: &mut Cluster) {
    let polling = name_with_primary(&cluster.brokers[0], "poll/yes", "b1").await;
    let sleeping = name_with_primary(&cluster.brokers[0], "poll/no", "b2").await;
    cluster
        .apply(&[spec(&polling, 3), spec(&sleeping, 3)])
        .await;
    for j in [&polling, &sleeping] {
        assert_eq!(agreed_route(cluster, j).await.members.len(), 3, "{j}");
    }
    let mut before = Vec::new();
    for b in &cluster.brokers {
        before.push(stat(b, "ack_polls").await);
    }
    let client = cluster.brokers[0].client().await;
    for j in [&polling, &sleeping] {
        let mut expected = Vec::new();
        for seq in 0..POLL_APPENDS {
            let content = record(0, seq, 1024);
            let r = client
                .append(&req(j), content.clone())
                .await
                .unwrap_or_else(|e| panic!("{j} append {seq}: {e}"));
            assert_eq!(r.begin, expected.len() as u64, "{j}: {r:?}");
            assert_eq!(r.sha1, sha1(&content), "{j}: {r:?}");
            expected.extend_from_slice(&content);
        }
        // Every member holds what was acknowledged, polling or not.
        for b in &cluster.brokers {
            assert_eq!(local_copy(b, j).await, expected, "{}: copy of {j}", b.id);
        }
    }
    let mut polls = Vec::new();
    for (b, before) in cluster.brokers.iter().zip(&before) {
        polls.push(stat(b, "ack_polls").await - before);
    }
    // b1 proposed each of its journal's appends and polled after it
    // (appends one at a time: one poll each, at most).
    assert!(
        (1..=u64::from(POLL_APPENDS)).contains(&polls[0]),
        "b1 polled {} times for {POLL_APPENDS} appends",
        polls[0]
    );
    assert!(stat(&cluster.brokers[0], "ack_poll_micros").await > 0);
    // b2, the other journal's primary, slept instead; b3 is a replica only.
    assert_eq!(polls[1], 0, "b2 runs with --ack-poll 0");
    assert_eq!(polls[2], 0, "b3 proposed nothing");
}

// ---------------------------------------------------------------------------
// A primary's connection holds a bounded count of open replicated appends.

/// A primary (here a test speaking the protocol, its broker killed) that
/// leaves more than 262,144 replicated appends open on one connection,
/// content sent and no proposal, is sent an ERROR of TOO_MANY_REQUESTS and
/// the connection is closed (PROTOCOL.md §14.2); the replica committed
/// none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_past_the_open_replicated_appends_is_closed() {
    let mut cluster = Cluster::start(2, CORES);
    let done = tokio::time::timeout(
        TEST_LIMIT,
        a_primary_past_the_open_replicated_appends_is_closed_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn a_primary_past_the_open_replicated_appends_is_closed_body(cluster: &mut Cluster) {
    const OPEN: u64 = 262_144;
    let j = "repl/open-ops";
    cluster.apply(&[spec(j, 2)]).await;
    let route = agreed_route(cluster, j).await;
    let listed = cluster.brokers[0].client().await.list("").await.unwrap();
    let info = listed.iter().find(|i| i.spec.name == j).expect("listed");
    let (spec, revision) = (info.spec.clone(), info.revision);
    cluster.by_id_mut(&route.members[0].id).kill9();
    let replica = cluster.by_id(&route.members[1].id);
    let endpoint = replica.endpoint();
    let sync = serde_json::to_vec(&rotary_net::repl::SyncRequest {
        seq: 1,
        journal: j.into(),
        spec,
        revision,
        route: ids(&route),
        route_revision: 0,
        head: 0,
        registers: LabelSet::default(),
        taken_back: Vec::new(),
    })
    .unwrap();
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        s.write_all(&frame(Op::SYNC, 0, 1, &[], &sync)).unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("the SYNC's ack");
        let acks = rotary_net::repl::decode_acks(&f.payload).expect("acks");
        assert_eq!((acks[0].seq, acks[0].status), (1, Status::OK), "{acks:?}");
        // One content record per append, none proposed: 262,145 in all.
        let mut seq = 2;
        while seq < OPEN + 3 {
            let mut w = rotary_net::wire::MetaWriter::new();
            for _ in 0..4096.min(OPEN + 3 - seq) {
                rotary_net::repl::Record::Content {
                    seq,
                    journal: j,
                    offset: seq - 2,
                    bytes: b"x",
                }
                .encode(&mut w);
                seq += 1;
            }
            s.write_all(&frame(Op::REPLICATE, 0, 0, &[], &w.into_payload()))
                .unwrap();
        }
        let f = read_raw_frame(&mut s).unwrap().expect("an ERROR");
        assert_eq!(
            (f.op, f.status),
            (Op::ERROR, Status::TOO_MANY_REQUESTS as u16),
            "{f:?}: {}",
            String::from_utf8_lossy(&f.payload)
        );
        assert!(
            String::from_utf8_lossy(&f.payload).contains("262144 replicated appends"),
            "{f:?}"
        );
        assert!(read_raw_frame(&mut s).unwrap().is_none(), "closed");
    });
    assert_eq!(local_head(replica, j).await, 0, "nothing was committed");
}

// ---------------------------------------------------------------------------
// A replica behind its primary at a SYNC copies what it missed.

/// A replica stopped while its primary commits an append misses it: the
/// primary answers REPLICATION_FAILED once the replica does not
/// acknowledge in time, and takes the append back (no other replica holds
/// it). The replica, killed while stopped and started again on its disk,
/// is synchronized by the next append: the append that failed is in
/// neither copy, and the two copies are the same byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_a_stopped_replica_missed_is_taken_back() {
    let mut cluster =
        tokio::task::block_in_place(|| start_with_ack_timeout(2, STOPPED_ACK_TIMEOUT, false));
    let done = tokio::time::timeout(
        TEST_LIMIT,
        an_append_a_stopped_replica_missed_is_taken_back_body(&mut cluster),
    )
    .await;
    cluster.finished(done, TEST_LIMIT);
}

async fn an_append_a_stopped_replica_missed_is_taken_back_body(cluster: &mut Cluster) {
    let j = "repl/fill-at-sync";
    cluster.apply(&[spec(j, 2)]).await;
    let route = agreed_route(cluster, j).await;
    let primary = cluster.index(&route.members[0].id);
    let replica = cluster.index(&route.members[1].id);
    let client = cluster.brokers[primary].pinned().await;
    append_retrying(&client, j, &record(1, 0, 1000)).await;

    let pid = cluster.brokers[replica].pid().expect("replica running");
    tokio::task::block_in_place(|| stop_process(pid));
    let missed = client.append(&req(j), record(1, 1, 2000)).await;
    assert_eq!(status_of(missed), Status::REPLICATION_FAILED);
    tokio::task::block_in_place(|| {
        cluster.brokers[replica].kill9();
        cluster.brokers[replica].start();
    });
    append_retrying(&client, j, &record(1, 2, 1500)).await;

    let p = &cluster.brokers[primary];
    let r = &cluster.brokers[replica];
    let head = local_head(p, j).await;
    let p_copy = local_copy(p, j).await;
    assert_eq!(p_copy.len() as u64, head);
    let found = parse_records(&p_copy, 0).unwrap_or_else(|e| panic!("primary: {e}"));
    let seqs: Vec<(u32, u32)> = found.iter().map(|f| (f.writer, f.seq)).collect();
    assert_eq!(
        seqs,
        vec![(1, 0), (1, 2)],
        "the primary took back the append no replica acknowledged"
    );
    assert_eq!(local_head(r, j).await, head, "the replica's head");
    let r_copy = local_copy(r, j).await;
    assert_eq!(
        hex_sha1(&r_copy),
        hex_sha1(&p_copy),
        "the replica's copy differs from the primary's"
    );
    assert!(
        p.log()
            .contains("took back appends that a replica did not acknowledge"),
        "the primary logged the take-back:\n{}",
        p.log()
    );
}

// ---------------------------------------------------------------------------
// The cluster file holds the journals' specs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_files_journals_are_on_every_broker_and_only_the_file_changes_them() {
    let mut cluster = Cluster::start(3, CORES);
    let done =
        tokio::time::timeout(TEST_LIMIT, the_cluster_files_journals_body(&mut cluster)).await;
    cluster.finished(done, TEST_LIMIT);
}

/// Two journals from the cluster file take appends, copied to each
/// member. APPLY and DELETE through any broker are refused with
/// NOT_ALLOWED and change nothing. A journal taken out of the file is
/// deleted on every broker, files and all; put back, it starts empty.
async fn the_cluster_files_journals_body(cluster: &mut Cluster) {
    let (a, b) = ("repl/file-a", "repl/file-b");
    cluster.apply(&[spec(a, 3), spec(b, 2)]).await;
    let client = cluster.brokers[0].client().await;
    for j in [a, b] {
        append_retrying(&client, j, format!("bytes of {j};").as_bytes()).await;
        let route = agreed_route(cluster, j).await;
        for m in &route.members {
            let copy = local_copy(cluster.by_id(&m.id), j).await;
            assert_eq!(copy, format!("bytes of {j};").as_bytes(), "{j} on {}", m.id);
        }
    }
    for broker in &cluster.brokers {
        let c = broker.client().await;
        let applied = c.apply(&[spec("repl/file-c", 1)]).await;
        assert_eq!(
            status_of(applied),
            Status::NOT_ALLOWED,
            "APPLY on {}",
            broker.id
        );
        assert_eq!(status_of(c.delete(a).await), Status::NOT_ALLOWED);
        let names: Vec<String> = c
            .list("")
            .await
            .unwrap()
            .into_iter()
            .map(|j| j.spec.name)
            .collect();
        assert_eq!(names, [a, b], "{}", broker.id);
    }
    let held: Vec<usize> = (0..3)
        .filter(|&i| cluster.brokers[i].holds_files_of(a))
        .collect();
    assert_eq!(held.len(), 3, "every member of {a} has its files");
    cluster.delete(a).await;
    for broker in &cluster.brokers {
        append_until_not_found(&broker.pinned().await, a).await;
    }
    let deadline = Instant::now() + WAIT;
    for broker in &cluster.brokers {
        while broker.holds_files_of(a) {
            assert!(
                Instant::now() < deadline,
                "{} keeps the files of {a}",
                broker.id
            );
            tokio::time::sleep(POLL).await;
        }
    }
    // The other journal goes on as it was; the one put back starts empty.
    append_retrying(&client, b, b"more;").await;
    cluster.apply(&[spec(a, 3)]).await;
    let r = append_retrying(&client, a, b"again;").await;
    assert_eq!((r.begin, r.end), (0, 6), "{r:?}");
    // Each broker counted its own revisions; the same specs still show
    // the same digest everywhere.
    let mut digests = Vec::new();
    for broker in &cluster.brokers {
        let stats = broker.client().await.stats().await.unwrap();
        assert_eq!(stats["specs"], 2, "{}", broker.id);
        digests.push(stats["specs_digest"].as_str().unwrap().to_string());
    }
    assert!(digests.iter().all(|d| *d == digests[0]), "{digests:?}");
}
