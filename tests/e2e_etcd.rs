//! A cluster on etcd, end to end: a real `etcd` and real `rotary serve
//! --etcd` processes on loopback. Journals are assigned by the allocator,
//! move when a broker dies or leaves, and never lose an acknowledged byte.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::etcd_cluster::EtcdCluster;
use common::{parse_records, read_range, record, run_cli, sha1, status_of};
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
/// How long writers that must get past a hung broker wait for a silent
/// connection before probing it (it fails at twice this).
const HUNG_SILENCE: Duration = Duration::from_secs(2);

/// Applies `specs` through the CLI, as YAML; returns the exit code and stderr.
fn apply_yaml(c: &EtcdCluster, yaml: &str) -> (i32, String) {
    let (code, _, err) = run_cli(c.cli(&["journals", "apply", "-f", "-"]), yaml.as_bytes());
    (code, err)
}

/// When each acknowledged append was sent, and when its ack came.
type Times = Arc<Mutex<Vec<(Instant, Instant)>>>;

/// What each writer had acknowledged: (writer, seq) → offsets.
type Acked = Arc<Mutex<BTreeMap<(u32, u32), (u64, u64)>>>;

/// Writers appending records to a journal one after another, each waiting
/// for its ack, until stopped. Each ack is recorded with the offsets it
/// gave and when its append was sent and acknowledged (for the time to the
/// first ack after a fault); each failure with its error.
struct Load {
    acked: Acked,
    times: Times,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &Client, journal: &str, writers: u32) -> Load {
        let mut load = Load {
            acked: Arc::default(),
            times: Arc::default(),
            failures: Arc::default(),
            stop: Arc::default(),
            tasks: Vec::new(),
        };
        for w in 0..writers {
            let (client, journal) = (client.clone(), journal.to_string());
            let (acked, times) = (load.acked.clone(), load.times.clone());
            let (failures, stop) = (load.failures.clone(), load.stop.clone());
            load.tasks.push(tokio::spawn(async move {
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
            }));
        }
        load
    }

    /// Stops the writers; returns what was acknowledged and what failed.
    async fn finish(self) -> (BTreeMap<(u32, u32), (u64, u64)>, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("writer");
        }
        let acked = self.acked.lock().unwrap().clone();
        let failed = self.failures.lock().unwrap().clone();
        (acked, failed)
    }
}

/// A reader tailing a journal from offset 0 with a blocking direct read,
/// through whatever happens to the brokers, collecting what it is given.
struct Tail {
    /// Stop once this many bytes are read (`u64::MAX` until known).
    until: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<Result<Spans, String>>,
}

impl Tail {
    fn start(client: Client, journal: &str) -> Tail {
        use std::sync::atomic::Ordering::Relaxed;
        let until = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        let req = rotary_net::wire::ReadRequest {
            journal: journal.into(),
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        };
        let stop = until.clone();
        let task = tokio::spawn(async move {
            let mut read = client.read_direct(&req, true);
            let mut got = Spans::default();
            while got.end() < stop.load(Relaxed) {
                let tick = tokio::time::sleep(Duration::from_millis(100));
                let ev = tokio::select! {
                    ev = read.next() => ev,
                    _ = tick => continue,
                };
                match ev {
                    Some(Ok(rotary_net::client::ReadEvent::Data { offset, content })) => {
                        got.push(offset, &content)?
                    }
                    other => return Err(format!("the tailing read ended: {other:?}")),
                }
            }
            Ok(got)
        });
        Tail { until, task }
    }

    /// What was read, once it reached `head`.
    async fn finish(self, head: u64) -> Spans {
        self.until.store(head, std::sync::atomic::Ordering::Relaxed);
        let got = tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the tailing reader reaches the head")
            .expect("reader task");
        got.unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A journal as one reader was given it: spans of bytes in offset order.
/// A copy lacks a span where its primary synchronized it past an append
/// whose outcome the primary could not learn (answered REPLICATION_FAILED,
/// never acknowledged); a read skips it (PROTOCOL.md §7), and so a span
/// ends there.
#[derive(Debug, Default)]
struct Spans(Vec<(u64, Vec<u8>)>);

impl Spans {
    /// Takes bytes read at `offset`: they continue the last span or, past
    /// its end, begin a new one.
    fn push(&mut self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let end = self.end();
        match self.0.last_mut() {
            Some((_, last)) if offset == end => last.extend_from_slice(bytes),
            _ if offset < end => return Err(format!("data at {offset} before {end}")),
            _ => self.0.push((offset, bytes.to_vec())),
        }
        Ok(())
    }

    fn end(&self) -> u64 {
        self.0.last().map_or(0, |(o, b)| o + b.len() as u64)
    }

    /// Every acknowledged record that begins at `from` or later is held,
    /// at the offsets its ack gave.
    fn check_acked(&self, what: &str, acked: &BTreeMap<(u32, u32), (u64, u64)>, from: u64) {
        let mut at: BTreeMap<(u32, u32), Vec<(u64, u64)>> = BTreeMap::new();
        for (offset, bytes) in &self.0 {
            let found = parse_records(bytes, *offset).unwrap_or_else(|e| panic!("{what}: {e}"));
            for f in found {
                at.entry((f.writer, f.seq))
                    .or_default()
                    .push((f.begin, f.end));
            }
        }
        for (key, offsets) in acked.iter().filter(|(_, (b, _))| *b >= from) {
            let places = at.get(key).map(Vec::as_slice).unwrap_or_default();
            assert!(
                places.contains(offsets),
                "{what}: acknowledged record {key:?} at {offsets:?} is not held (found at {places:?}; spans {:?})",
                self.0.iter().map(|(o, b)| (*o, *o + b.len() as u64)).collect::<Vec<_>>()
            );
        }
    }

    /// One span, without a hole: a replica that missed appends its
    /// primary committed copied them when it was synchronized again.
    fn check_whole(&self, what: &str) {
        let spans: Vec<(u64, u64)> = self
            .0
            .iter()
            .map(|(o, b)| (*o, *o + b.len() as u64))
            .collect();
        assert!(spans.len() <= 1, "{what}'s copy has holes: {spans:?}");
    }

    /// Holds the same bytes as `other` wherever both hold bytes.
    fn check_agrees(&self, what: &str, other: &Spans) {
        for (a, ab) in &self.0 {
            for (b, bb) in &other.0 {
                let begin = (*a).max(*b);
                let end = (a + ab.len() as u64).min(b + bb.len() as u64);
                if begin < end {
                    let mine = &ab[(begin - a) as usize..(end - a) as usize];
                    let theirs = &bb[(begin - b) as usize..(end - b) as usize];
                    assert!(mine == theirs, "{what}: bytes [{begin}, {end}) differ");
                }
            }
        }
    }
}

/// `[from, to)` of `journal` as broker `endpoint` holds it.
async fn held_spans(endpoint: &str, journal: &str, from: u64, to: u64) -> Spans {
    let client = Client::connect_pinned(endpoint)
        .await
        .expect("connect pinned");
    let req = rotary_net::wire::ReadRequest {
        journal: journal.into(),
        offset: Some(from),
        end_offset: Some(to),
        route_revision: 0,
    };
    let mut stream = client
        .read(&req, false, false)
        .await
        .unwrap_or_else(|e| panic!("pinned read of {journal} at {endpoint}: {e}"));
    let mut spans = Spans::default();
    loop {
        match stream.next().await {
            Some(Ok(rotary_net::client::ReadEvent::Data { offset, content })) => spans
                .push(offset, &content)
                .unwrap_or_else(|e| panic!("{endpoint}: {e}")),
            Some(Ok(rotary_net::client::ReadEvent::Done(done))) => {
                assert_eq!(done.status, Status::OK, "{endpoint}: {done:?}");
                return spans;
            }
            other => panic!("pinned read of {journal} at {endpoint}: {other:?}"),
        }
    }
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
    // Deleted in etcd, the journal goes from every member, files and all.
    for id in &info.route.members {
        assert!(
            c.brokers[c.index(id)].holds_files_of("etcd/assigned"),
            "{id}"
        );
    }
    client.delete("etcd/assigned").await.expect("delete");
    let deadline = Instant::now() + Duration::from_secs(10);
    for b in &c.brokers {
        while b.holds_files_of("etcd/assigned") {
            assert!(
                Instant::now() < deadline,
                "{} keeps the files of a deleted journal",
                b.id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let req = AppendRequest {
        journal: "etcd/assigned".into(),
        ..AppendRequest::default()
    };
    let refused = c
        .client(Duration::ZERO)
        .await
        .append(&req, &b"late"[..])
        .await;
    assert_eq!(status_of(refused), Status::JOURNAL_NOT_FOUND);
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
    let load = Load::start(&client, journal, 4);
    let tail = Tail::start(c.client(WRITER_RETRY).await, journal);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The primary dies.
    let primary = first.route.primary.clone();
    let killed_at = Instant::now();
    let i = c.index(&primary);
    c.brokers[i].kill9();
    // A read opened at once, while the route still names the dead primary
    // (its lease has not expired), cannot be sent there; it is sent again
    // until the route has moved.
    first_byte(&c.client(WRITER_RETRY).await, journal).await;
    let second = c.assigned(journal, 3).await;
    assert_ne!(second.route.primary, primary);
    wait_for_ack_after(&load.times, killed_at).await;
    eprintln!(
        "first acknowledged append {:?} after the primary was killed",
        first_ack_after(&load.times, killed_at).expect("an ack") - killed_at
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
    wait_for_ack_after(&load.times, killed_at).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (acked, failed) = load.finish().await;
    assert!(failed.is_empty(), "appends failed: {failed:#?}");

    // The journal has every acknowledged record, and each live member's
    // copy agrees with the primary's over what both hold.
    let last = c.assigned(journal, 3).await;
    let head = common::write_head(&client, journal).await;
    let primary = &c.brokers[c.index(&last.route.primary)];
    let all = held_spans(&primary.endpoint(), journal, 0, head).await;
    all.check_acked("the primary", &acked, 0);
    all.check_whole("the primary");
    // The reader that tailed the journal throughout followed it from
    // broker to broker and read every byte once, in order.
    let tailed = tail.finish(all.end()).await;
    tailed.check_acked("the tailing reader", &acked, 0);
    tailed.check_agrees("the tailing reader", &all);
    for id in &last.route.members {
        let b = &c.brokers[c.index(id)];
        // A replica added after the kills holds the bytes from its join on.
        let from = member_first_offset(&b.endpoint(), journal).await;
        let copy = held_spans(&b.endpoint(), journal, from, head).await;
        copy.check_acked(id, &acked, from);
        copy.check_agrees(id, &all);
        copy.check_whole(id);
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

/// Reads the journal's first byte with a plain read (not a direct one).
async fn first_byte(client: &Client, journal: &str) {
    let req = rotary_net::wire::ReadRequest {
        journal: journal.into(),
        offset: Some(0),
        end_offset: Some(1),
        route_revision: 0,
    };
    let mut stream = client
        .read(&req, false, false)
        .await
        .unwrap_or_else(|e| panic!("a read of {journal} opened: {e}"));
    match stream.next().await {
        Some(Ok(rotary_net::client::ReadEvent::Data { offset, content })) => {
            assert_eq!((offset, content.len()), (0, 1));
        }
        other => panic!("the first byte of {journal}: {other:?}"),
    }
}

/// The first offset a member's own copy holds (0 unless it joined later),
/// by its local fragments (a store's hold history no member may have).
async fn member_first_offset(endpoint: &str, journal: &str) -> u64 {
    let client = Client::connect_pinned(endpoint).await.expect("connect");
    let fragments = client.fragments(journal).await.expect("fragments");
    fragments
        .iter()
        .filter(|f| f.store == "local")
        .map(|f| f.begin)
        .min()
        .unwrap_or(0)
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

/// Waits, asking the brokers `others`, until `journal` has a route of
/// three members without `gone` (a broker stopped or cut off); returns it.
async fn moved_away(
    c: &EtcdCluster,
    others: &[usize],
    journal: &str,
    gone: &str,
) -> rotary_net::client::JournalInfo {
    let lister = client_of(c, others, Duration::ZERO).await;
    let deadline = Instant::now() + common::etcd_cluster::ASSIGN_TIMEOUT;
    loop {
        let list = lister.list("").await.unwrap_or_default();
        let j = list.iter().find(|j| j.spec.name == journal).cloned();
        if let Some(j) = j {
            if j.route.members.len() == 3 && !j.route.members.iter().any(|m| m == gone) {
                return j;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{journal} still routed to {gone}: {list:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A client bootstrapped at the brokers `at` (indexes) only, retrying
/// appends for `retry`, and giving up on a connection silent for twice
/// [`HUNG_SILENCE`] (a hung broker answers nothing, not even a PING).
async fn client_of(c: &EtcdCluster, at: &[usize], retry: Duration) -> Client {
    let endpoints: Vec<String> = at.iter().map(|&i| c.brokers[i].endpoint()).collect();
    let options = rotary_net::client::ClientOptions {
        retry_for: retry,
        silence: HUNG_SILENCE,
        ..rotary_net::client::ClientOptions::default()
    };
    Client::connect_with(&endpoints.join(","), options)
        .await
        .unwrap_or_else(|e| panic!("connect to {endpoints:?}: {e}"))
}

/// Every acknowledged record is in `journal` and on each member of its
/// route (from the offset it joined at on), and the members agree with
/// the primary wherever both hold bytes; returns the primary's bytes.
async fn check_journal_and_members(
    c: &EtcdCluster,
    client: &Client,
    journal: &str,
    route: &rotary_net::client::JournalInfo,
    acked: &BTreeMap<(u32, u32), (u64, u64)>,
) -> Spans {
    let head = common::write_head(client, journal).await;
    let primary = &c.brokers[c.index(&route.route.primary)];
    let all = held_spans(&primary.endpoint(), journal, 0, head).await;
    all.check_acked("the primary", acked, 0);
    all.check_whole("the primary");
    for id in &route.route.members {
        let b = &c.brokers[c.index(id)];
        let from = member_first_offset(&b.endpoint(), journal).await;
        let copy = held_spans(&b.endpoint(), journal, from, head).await;
        copy.check_acked(id, acked, from);
        copy.check_agrees(id, &all);
        copy.check_whole(id);
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_fails_no_append() {
    let mut c = EtcdCluster::start(4, 1, TTL);
    let journal = "etcd/rolling";
    // Each broker comes back holding nothing of the journal, and after
    // the last restart no broker holds its first bytes: its history lives
    // in its store, where each broker's exit uploads its spools.
    let store = tempfile::tempdir().expect("store dir");
    let yaml = format!(
        "- {{name: {journal}, replication: 3, fragment: {{stores: [\"file://{}/\"], refresh_interval: 1s}}}}\n",
        store.path().display()
    );
    let (code, err) = apply_yaml(&c, &yaml);
    assert_eq!(code, 0, "{err}");
    c.assigned(journal, 3).await;

    let client = c.client(WRITER_RETRY).await;
    let load = Load::start(&client, journal, 2);
    tokio::time::sleep(Duration::from_millis(500)).await;

    for i in 0..c.brokers.len() {
        let began = Instant::now();
        // The drain blocks this thread; the writers go on elsewhere.
        tokio::task::block_in_place(|| c.brokers[i].stop_graceful());
        let drained = began.elapsed();
        tokio::task::block_in_place(|| c.brokers[i].start());
        let route = c.assigned(journal, 3).await;
        eprintln!(
            "{}: exited {drained:?} after SIGTERM, route {:?} after {:?}",
            c.brokers[i].id,
            route.route,
            began.elapsed()
        );
        wait_for_ack_after(&load.times, began).await;
    }
    let (acked, failed) = load.finish().await;
    assert!(failed.is_empty(), "appends failed: {failed:#?}");
    let acks = acked.len();
    assert!(acks > 0);
    eprintln!("{acks} appends acknowledged during the rolling restart");

    let last = c.assigned(journal, 3).await;
    // Fragments the drained brokers uploaded on their way out reach the
    // primary's index with its next listing of the store.
    let primary = Client::connect_pinned(&c.brokers[c.index(&last.route.primary)].endpoint())
        .await
        .expect("connect pinned");
    let deadline = Instant::now() + WRITER_RETRY;
    loop {
        let fragments = primary.fragments(journal).await.expect("fragments");
        match first_gap(&fragments) {
            None => break,
            Some(gap) => assert!(
                Instant::now() < deadline,
                "{journal}'s fragments leave {gap:?} uncovered: {fragments:#?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check_journal_and_members(&c, &client, journal, &last, &acked).await;
}

/// The first range from 0 that none of `fragments` covers, below their end.
fn first_gap(fragments: &[rotary_net::client::FragmentInfo]) -> Option<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = fragments.iter().map(|f| (f.begin, f.end)).collect();
    sorted.sort();
    let mut covered = 0;
    for (begin, end) in sorted {
        if begin > covered {
            return Some((covered, begin));
        }
        covered = covered.max(end);
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_go_on_while_etcd_is_down_and_the_cluster_recovers() {
    let mut c = EtcdCluster::start(3, 1, TTL);
    let journal = "etcd/outage";
    let (code, err) = apply_yaml(&c, &format!("- {{name: {journal}, replication: 3}}\n"));
    assert_eq!(code, 0, "{err}");
    let before = c.assigned(journal, 3).await;

    let client = c.client(WRITER_RETRY).await;
    let load = Load::start(&client, journal, 2);
    tokio::time::sleep(Duration::from_millis(500)).await;

    c.etcd.stop();
    let stopped = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let restarted = Instant::now();
    let during = load
        .times
        .lock()
        .unwrap()
        .iter()
        .filter(|(sent, acked)| *sent > stopped && *acked < restarted)
        .count();
    c.etcd.restart().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{during} appends acknowledged while etcd was down");
    assert!(during > 0, "no append acknowledged while etcd was down");
    {
        let failed = load.failures.lock().unwrap().clone();
        assert!(
            failed.is_empty(),
            "appends failed while etcd was down: {failed:#?}"
        );
    }

    // The cluster picks up where it was: a journal applied now is
    // assigned and takes appends, and the first one keeps its route.
    let (code, err) = apply_yaml(&c, "- {name: etcd/after, replication: 3}\n");
    assert_eq!(code, 0, "{err}");
    c.assigned("etcd/after", 3).await;
    let req = AppendRequest {
        journal: "etcd/after".into(),
        ..AppendRequest::default()
    };
    let r = record(9, 0, 200);
    let reply = client.append(&req, r.clone()).await.expect("append");
    assert_eq!((reply.begin, reply.end), (0, r.len() as u64));
    wait_for_ack_after(&load.times, Instant::now()).await;

    let (acked, failed) = load.finish().await;
    assert!(failed.is_empty(), "appends failed: {failed:#?}");
    let after = c.assigned(journal, 3).await;
    assert_eq!(after.route.primary, before.route.primary);
    check_journal_and_members(&c, &client, journal, &after, &acked).await;
    let copy = pinned_copy(
        &c.brokers[c.index(&after.route.primary)].endpoint(),
        "etcd/after",
        0,
        r.len() as u64,
    )
    .await;
    assert_eq!(sha1(&copy), sha1(&r));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_paused_past_its_lease_acknowledges_nothing_after() {
    let c = EtcdCluster::start(4, 1, TTL);
    let journal = "etcd/paused";
    let (code, err) = apply_yaml(&c, &format!("- {{name: {journal}, replication: 3}}\n"));
    assert_eq!(code, 0, "{err}");
    let first = c.assigned(journal, 3).await;
    let paused_id = first.route.primary.clone();
    let paused = c.index(&paused_id);
    let others: Vec<usize> = (0..c.brokers.len()).filter(|&i| i != paused).collect();

    // The writers know the cluster by the other brokers (a hung broker
    // answers nothing, not even where a route went), and give up on an
    // append in flight to it after a few seconds of silence, to try the
    // new primary.
    let client = client_of(&c, &others, WRITER_RETRY).await;
    let load = Load::start(&client, journal, 2);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let pid = c.brokers[paused].pid().expect("running");
    common::stop_process(pid);
    let paused_at = Instant::now();
    // The others promote a new primary, without the paused broker.
    let moved = moved_away(&c, &others, journal, &paused_id).await;
    assert_ne!(moved.route.primary, paused_id);
    eprintln!("route {:?} after {:?}", moved.route, paused_at.elapsed());
    wait_for_ack_after(&load.times, Instant::now()).await;
    // Well past its lease.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Woken, the old primary acknowledges nothing as primary, however it
    // sees the journal at first.
    common::continue_process(pid);
    let pinned = Client::connect_pinned(&c.brokers[paused].endpoint())
        .await
        .expect("connect pinned");
    let req = AppendRequest {
        journal: journal.into(),
        ..AppendRequest::default()
    };
    let stale = pinned
        .append_with(
            &req,
            record(99, 0, 100),
            rotary_net::client::AppendOptions { do_not_proxy: true },
        )
        .await;
    eprintln!("append to the woken broker: {stale:?}");
    assert!(
        stale.is_err(),
        "the paused primary acknowledged an append: {stale:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    let (acked, failed) = load.finish().await;
    assert!(failed.is_empty(), "appends failed: {failed:#?}");
    let last = c.assigned(journal, 3).await;
    let all = check_journal_and_members(&c, &client, journal, &last, &acked).await;
    for (offset, bytes) in &all.0 {
        let found = parse_records(bytes, *offset).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            found.iter().all(|f| f.writer != 99),
            "the refused append is in the journal"
        );
    }
    // If it is not the primary again, it still refuses appends.
    if last.route.primary != paused_id {
        let r = pinned
            .append_with(
                &req,
                record(99, 1, 100),
                rotary_net::client::AppendOptions { do_not_proxy: true },
            )
            .await;
        let s = status_of(r);
        assert!(
            s == Status::NOT_JOURNAL_PRIMARY_BROKER || s == Status::NOT_JOURNAL_BROKER,
            "{s:?}"
        );
    }
}

/// Requests carry the etcd revision their route was read at. A broker
/// that has not seen it waits for its watch to get there, and refuses with
/// WRONG_ROUTE (naming its own revision) only if it does not in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_routed_at_a_later_revision_wait_for_the_broker_to_reach_it() {
    let c = EtcdCluster::start(2, 1, TTL);
    let journal = "etcd/revised";
    let (code, err) = apply_yaml(&c, &format!("- {{name: {journal}, replication: 1}}\n"));
    assert_eq!(code, 0, "{err}");
    let info = c.assigned(journal, 1).await;
    let primary = &c.brokers[c.index(&info.route.primary)];
    let client = Client::connect(&primary.endpoint()).await.expect("connect");
    let seen = client.route(journal).await.expect("route").revision;
    assert!(seen > 0, "a route read from etcd has a revision");
    let req = |revision: u64| AppendRequest {
        journal: journal.into(),
        route_revision: revision,
        ..AppendRequest::default()
    };
    let at_seen = req(seen);
    let first = client.append(&at_seen, &b"at the route's revision\n"[..]);
    let first = first.await.expect("append");

    // A revision no watch will reach: refused once the wait is over, with
    // the revision the broker has.
    let far = seen + 1_000_000;
    let e = client.append(&req(far), &b"never\n"[..]).await.unwrap_err();
    assert_eq!(e.status(), Some(Status::WRONG_ROUTE), "{e}");
    let answered = e.append_reply().expect("reply").route_revision;
    assert!(answered >= seen && answered < far, "answered at {answered}");
    let e = client.route_at(journal, far).await.unwrap_err();
    assert_eq!(e.status(), Some(Status::WRONG_ROUTE), "{e}");
    let read = rotary_net::wire::ReadRequest {
        journal: journal.into(),
        offset: Some(0),
        end_offset: None,
        route_revision: far,
    };
    let mut stream = client.read(&read, false, false).await.expect("read");
    match stream.next().await {
        Some(Ok(rotary_net::client::ReadEvent::Done(done))) => {
            assert_eq!(done.status, Status::WRONG_ROUTE, "{done:?}");
            assert!(done.route_revision >= seen && done.route_revision < far);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // The next revision: the append and the ROUTE wait until a change in
    // etcd brings the broker there, and are answered after it, not before.
    let now = client.route(journal).await.expect("route").revision;
    let waiting = {
        let client = client.clone();
        let req = req(now + 1);
        tokio::spawn(async move {
            let r = client.append(&req, &b"after the next change\n"[..]).await;
            (r, Instant::now())
        })
    };
    let routing = {
        let client = client.clone();
        tokio::spawn(async move {
            let r = client.route_at(journal, now + 1).await;
            (r, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let changed_at = Instant::now();
    let (code, err) = apply_yaml(&c, "- {name: etcd/another, replication: 1}\n");
    assert_eq!(code, 0, "{err}");
    let (appended, appended_at) = waiting.await.expect("task");
    let appended = appended.expect("the append waited and was taken");
    assert_eq!(appended.begin, first.end);
    assert!(appended_at > changed_at, "answered before the change");
    let (routed, routed_at) = routing.await.expect("task");
    assert!(routed.expect("route").revision > now);
    assert!(routed_at > changed_at, "answered before the change");
    let stats = client.stats().await.expect("stats");
    // The ROUTE shares the append's connection, and is read after it.
    assert!(stats["route_revision_waits"].as_u64() >= Some(1), "{stats}");
    assert!(
        stats["route_revision_timeouts"].as_u64() >= Some(3),
        "{stats}"
    );
}

/// Writers pinned to one broker (no retries, `DO_NOT_PROXY`), each with
/// one append in flight at a time, recording what was acknowledged into
/// `acked` under writer ids from `first_writer` on: appends sent to a
/// primary while it is stopped wait in its queue.
fn pinned_writers(
    client: &Client,
    journal: &str,
    first_writer: u32,
    writers: u32,
    acked: &Acked,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (first_writer..first_writer + writers)
        .map(|w| {
            let (client, journal) = (client.clone(), journal.to_string());
            let (acked, stop) = (acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seq = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = AppendRequest {
                        journal: journal.clone(),
                        ..AppendRequest::default()
                    };
                    let options = rotary_net::client::AppendOptions { do_not_proxy: true };
                    let len = 100 + (seq as usize * 53) % 700;
                    if let Ok(r) = client.append_with(&req, record(w, seq, len), options).await {
                        acked.lock().unwrap().insert((w, seq), (r.begin, r.end));
                    } else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    seq += 1;
                }
            })
        })
        .collect()
}

/// A fragment file's bytes, checked against the SHA-1 its name gives.
fn checked_fragment(path: &std::path::Path) -> Option<(u64, Vec<u8>)> {
    let name = path.file_name()?.to_str()?;
    let f = common::store::parse_fragment_name(name)?;
    let stored = std::fs::read(path).expect("read fragment file");
    let bytes = common::store::decode(f.codec, &stored).expect("decode fragment");
    assert_eq!(
        common::hex_sha1(&bytes),
        f.sha1,
        "{path:?} does not hold the bytes its name gives"
    );
    assert_eq!(bytes.len() as u64, f.end - f.begin, "{path:?}'s length");
    Some((f.begin, bytes))
}

/// Every fragment file of `journal` under `dir` (a `file://` store, or a
/// broker's data directory without the data of its earlier runs), each
/// checked against its name.
fn fragment_files(dir: &std::path::Path, journal: &str) -> Vec<(u64, Vec<u8>)> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "retired") {
                    dirs.push(path);
                }
            } else if path.to_string_lossy().contains(journal) {
                found.extend(checked_fragment(&path));
            }
        }
    }
    found.sort_by_key(|(b, bytes)| (*b, bytes.len()));
    found
}

/// No two fragments disagree over the offsets both hold, and every
/// acknowledged record a fragment spans is in it at its offsets.
fn check_fragments(
    what: &str,
    fragments: &[(u64, Vec<u8>)],
    acked: &BTreeMap<(u32, u32), (u64, u64)>,
) {
    let spans: Vec<Spans> = fragments
        .iter()
        .map(|(b, bytes)| Spans(vec![(*b, bytes.clone())]))
        .collect();
    for (i, (b, bytes)) in fragments.iter().enumerate() {
        let end = b + bytes.len() as u64;
        let within: BTreeMap<_, _> = acked
            .iter()
            .filter(|(_, (ab, ae))| ab >= b && *ae <= end)
            .map(|(k, v)| (*k, *v))
            .collect();
        let name = format!("{what}: fragment [{b}, {end})");
        spans[i].check_acked(&name, &within, 0);
        for other in &spans[i + 1..] {
            spans[i].check_agrees(&name, other);
        }
    }
}

/// Waits until the store's fragments cover `[0, head)` of the journal.
async fn stored_through(store: &std::path::Path, journal: &str, head: u64) -> Vec<(u64, Vec<u8>)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let fragments = fragment_files(store, journal);
        let mut covered = 0;
        for (b, bytes) in &fragments {
            if *b <= covered {
                covered = covered.max(b + bytes.len() as u64);
            }
        }
        if covered >= head {
            return fragments;
        }
        assert!(
            Instant::now() < deadline,
            "the store covers [0, {covered}) of [0, {head})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A primary stopped past its lease with appends queued on it, then woken:
/// it may commit them into its spool before it learns that another broker
/// took the journal over, but its replicas refuse them, so it takes them
/// back. Nothing it never had acknowledged reaches its fragments or the
/// store: every member's files, every member's own copy and the store hold
/// each acknowledged record at its offsets, and no two fragments disagree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_primary_takes_back_what_it_queued_and_uploads_no_conflict() {
    let c = EtcdCluster::start(4, 1, TTL);
    let store = tempfile::tempdir().expect("store dir");
    let journal = "etcd/queued";
    let spec = format!(
        "- {{name: {journal}, replication: 3, fragment: {{stores: [\"file://{}/\"], refresh_interval: 1s}}}}\n",
        store.path().display()
    );
    let (code, err) = apply_yaml(&c, &spec);
    assert_eq!(code, 0, "{err}");
    let first = c.assigned(journal, 3).await;
    let paused_id = first.route.primary.clone();
    let paused = c.index(&paused_id);
    let others: Vec<usize> = (0..c.brokers.len()).filter(|&i| i != paused).collect();

    let client = client_of(&c, &others, WRITER_RETRY).await;
    let load = Load::start(&client, journal, 2);
    let pinned = Client::connect_pinned(&c.brokers[paused].endpoint())
        .await
        .expect("connect pinned");
    let stop_pinned = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pinned_tasks = pinned_writers(&pinned, journal, 10, 4, &load.acked, &stop_pinned);
    tokio::time::sleep(Duration::from_millis(700)).await;

    let pid = c.brokers[paused].pid().expect("running");
    common::stop_process(pid);
    // Past the lease, with the journal moved and appended to elsewhere.
    moved_away(&c, &others, journal, &paused_id).await;
    wait_for_ack_after(&load.times, Instant::now()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    common::continue_process(pid);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_pinned.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in pinned_tasks {
        t.await.expect("pinned writer");
    }
    let (acked, failed) = load.finish().await;
    assert!(failed.is_empty(), "appends failed: {failed:#?}");
    let taken_back = pinned.stats().await.map(|s| s["taken_back_bytes"].clone());
    eprintln!("the woken broker took back {taken_back:?} bytes");

    // Each member's own copy, then everything sealed into the store.
    let last = c.assigned(journal, 3).await;
    check_journal_and_members(&c, &client, journal, &last, &acked).await;
    let (code, _, err) = run_cli(c.cli(&["journals", "seal", journal]), b"");
    assert_eq!(code, 0, "{err}");
    let head = common::write_head(&client, journal).await;
    let stored = stored_through(store.path(), journal, head).await;
    check_fragments("the store", &stored, &acked);
    // Every broker's local fragments, the woken one's included, agree with
    // the store and hold what was acknowledged.
    for b in &c.brokers {
        let mut all = fragment_files(&b.data, journal);
        check_fragments(&b.id, &all, &acked);
        all.extend(stored.iter().cloned());
        check_fragments(&format!("{} and the store", b.id), &all, &acked);
    }
}
