//! A cluster on etcd through the faults that once broke it for good: etcd
//! paused past the lease TTL (every broker's lease expires at once when it
//! resumes), etcd killed and started again on its data, and two brokers
//! killed together and started again. Four brokers in four zones, lease TTL
//! 3 s, journals of replication 3 and 2 under a steady load. After each
//! fault the cluster is whole again within seconds (every broker a member,
//! one primary per journal, routes of distinct members), etcd never holds
//! two primaries of a journal or one member twice (checked on etcd's keys
//! directly, all along), appends are acknowledged again, and every
//! acknowledged append is read back at its offsets, with its bytes, from
//! every member of its route.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::etcd_cluster::{assert_sound, EtcdCluster};
use common::{parse_records, record, run_cli};
use rotary_net::client::Client;
use rotary_net::wire::AppendRequest;
use rotary_net::Status;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TTL: &str = "3s";
/// How long writers keep trying an append through a fault.
const WRITER_RETRY: Duration = Duration::from_secs(30);
/// "Within a few seconds": how long the cluster may take to be whole
/// again once the fault is over.
const HEAL_MAX: Duration = Duration::from_secs(12);
const JOURNALS: [(&str, usize); 2] = [("faults/r3", 3), ("faults/r2", 2)];

/// (writer, seq) → the offsets its ack gave.
type Acked = BTreeMap<(u32, u32), (u64, u64)>;

/// Writers appending records to one journal, each waiting for its ack.
struct Load {
    journal: String,
    acked: Arc<Mutex<Acked>>,
    /// When each acknowledged append was sent and acknowledged.
    times: Arc<Mutex<Vec<(Instant, Instant)>>>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &Client, journal: &str, writers: u32) -> Load {
        let mut load = Load {
            journal: journal.into(),
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
                while !stop.load(Ordering::Relaxed) {
                    let req = AppendRequest {
                        journal: journal.clone(),
                        ..AppendRequest::default()
                    };
                    let len = 64 + (seq as usize * 37) % 700;
                    let sent = Instant::now();
                    match client.append(&req, record(w, seq, len)).await {
                        Ok(r) => {
                            acked.lock().unwrap().insert((w, seq), (r.begin, r.end));
                            times.lock().unwrap().push((sent, Instant::now()));
                        }
                        Err(e) => failures
                            .lock()
                            .unwrap()
                            .push(format!("{journal} writer {w} seq {seq}: {e}")),
                    }
                    seq += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }));
        }
        load
    }

    /// Appends sent after `from` and acknowledged before `to`.
    fn acked_between(&self, from: Instant, to: Instant) -> usize {
        let times = self.times.lock().unwrap();
        times.iter().filter(|(s, a)| *s > from && *a < to).count()
    }

    /// Waits for the ack of an append sent after `at`; returns when it came.
    async fn ack_after(&self, at: Instant) -> Instant {
        let deadline = Instant::now() + WRITER_RETRY;
        loop {
            let first = {
                let times = self.times.lock().unwrap();
                times.iter().filter(|(s, _)| *s > at).map(|(_, a)| *a).min()
            };
            if let Some(a) = first {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "{}: no append acknowledged after the fault",
                self.journal
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn finish(self) -> (Acked, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("writer");
        }
        let acked = self.acked.lock().unwrap().clone();
        let failed = self.failures.lock().unwrap().clone();
        (acked, failed)
    }
}

/// A cluster of 4 brokers with the two journals assigned, and a load on
/// each.
async fn loaded_cluster() -> (EtcdCluster, Client, Vec<Load>) {
    let c = EtcdCluster::start(4, 1, TTL);
    let yaml: String = JOURNALS
        .iter()
        .map(|(j, r)| format!("- {{name: {j}, replication: {r}}}\n"))
        .collect();
    let (code, _, err) = run_cli(c.cli(&["journals", "apply", "-f", "-"]), yaml.as_bytes());
    assert_eq!(code, 0, "{err}");
    for (j, r) in JOURNALS {
        c.assigned(j, r).await;
    }
    c.wait_whole(&JOURNALS, common::etcd_cluster::ASSIGN_TIMEOUT)
        .await;
    let client = c.client(WRITER_RETRY).await;
    let loads = JOURNALS
        .iter()
        .map(|(j, _)| Load::start(&client, j, 2))
        .collect();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    (c, client, loads)
}

/// Reads etcd's keys until `until`, asserting they are sound on every
/// read (etcd may not answer for part of the time).
async fn watch_soundness(c: &EtcdCluster, until: Instant) {
    while Instant::now() < until {
        if let Some((assigned, _)) = c.etcd_keys().await {
            assert_sound(&assigned);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// After a fault: the cluster is whole within [`HEAL_MAX`], appends are
/// acknowledged again, none failed, and every acknowledged append is held
/// by every member of its journal's route.
async fn check_healed(c: &EtcdCluster, client: &Client, loads: Vec<Load>, fault_over: Instant) {
    let took = c.wait_whole(&JOURNALS, HEAL_MAX).await;
    eprintln!("whole again {took:?} after the fault");
    for l in &loads {
        let at = l.ack_after(fault_over).await;
        eprintln!(
            "{}: first ack {:?} after the fault",
            l.journal,
            at - fault_over
        );
    }
    // A while on the healed cluster, its keys sound all along.
    watch_soundness(c, Instant::now() + Duration::from_secs(2)).await;
    for l in loads {
        let journal = l.journal.clone();
        let (acked, failed) = l.finish().await;
        assert!(failed.is_empty(), "appends failed: {failed:#?}");
        assert!(!acked.is_empty());
        let r = JOURNALS.iter().find(|(j, _)| *j == journal).unwrap().1;
        let route = c.assigned(&journal, r).await;
        let mut ids = route.route.members.clone();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), r, "{journal}: route {:?}", route.route);
        let head = common::write_head(client, &journal).await;
        for id in &route.route.members {
            let b = &c.brokers[c.index(id)];
            check_member(&b.endpoint(), id, &journal, &acked, head).await;
        }
    }
}

/// Every acknowledged record of `journal` from the first offset member
/// `id` holds on is read back from its own copy (a pinned read the broker
/// does not proxy) at the offsets its ack gave.
async fn check_member(endpoint: &str, id: &str, journal: &str, acked: &Acked, head: u64) {
    let client = Client::connect_pinned(endpoint)
        .await
        .expect("connect pinned");
    let fragments = client.fragments(journal).await.expect("fragments");
    let from = fragments
        .iter()
        .filter(|f| f.store == "local")
        .map(|f| f.begin)
        .min()
        .unwrap_or(0);
    let req = rotary_net::wire::ReadRequest {
        journal: journal.into(),
        offset: Some(from),
        end_offset: Some(head),
        route_revision: 0,
    };
    let mut stream = client
        .read(&req, false, false)
        .await
        .unwrap_or_else(|e| panic!("pinned read of {journal} at {id}: {e}"));
    let mut at: BTreeMap<(u32, u32), (u64, u64)> = BTreeMap::new();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    loop {
        match stream.next().await {
            Some(Ok(rotary_net::client::ReadEvent::Data { offset, content })) => {
                for f in parse_records(&content, offset).unwrap_or_else(|e| panic!("{id}: {e}")) {
                    at.insert((f.writer, f.seq), (f.begin, f.end));
                }
                spans.push((offset, offset + content.len() as u64));
            }
            Some(Ok(rotary_net::client::ReadEvent::Done(done))) => {
                assert_eq!(done.status, Status::OK, "{id}: {done:?}");
                break;
            }
            other => panic!("pinned read of {journal} at {id}: {other:?}"),
        }
    }
    let mut n = 0;
    for (key, offsets) in acked.iter().filter(|(_, (b, _))| *b >= from) {
        assert_eq!(
            at.get(key),
            Some(offsets),
            "{journal} on {id}: acknowledged record {key:?} is not held at its offsets (held from {from}: {spans:?})"
        );
        n += 1;
    }
    eprintln!("{journal} on {id}: {n} acknowledged records held from offset {from}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_paused_past_the_lease_ttl_heals_within_seconds() {
    let (c, client, loads) = loaded_cluster().await;
    let (_, before) = c.etcd_keys().await.expect("etcd answers");
    c.etcd.pause();
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let resumed = Instant::now();
    // Replicated journals take appends on their routes while etcd is away.
    for l in &loads {
        let during = l.acked_between(paused, resumed);
        eprintln!(
            "{}: {during} appends acknowledged during the pause",
            l.journal
        );
        assert!(
            during > 0,
            "{}: nothing acknowledged during the pause",
            l.journal
        );
    }
    c.etcd.resume();
    // Every lease expires now (etcd's clock ran on while it was stopped),
    // with every member key and assignment; the brokers rejoin.
    let took = c.wait_rejoined(&before, HEAL_MAX).await;
    eprintln!("every broker rejoined {took:?} after the pause");
    check_healed(&c, &client, loads, resumed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_started_again_heals_within_seconds() {
    let (mut c, client, loads) = loaded_cluster().await;
    c.etcd.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let back = Instant::now();
    for l in &loads {
        let during = l.acked_between(killed, back);
        assert!(
            during > 0,
            "{}: nothing acknowledged while etcd was down",
            l.journal
        );
    }
    c.etcd.restart().unwrap_or_else(|e| panic!("{e}"));
    check_healed(&c, &client, loads, back).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_killed_together_and_started_again_heal_within_seconds() {
    let (mut c, client, loads) = loaded_cluster().await;
    // The primary of the journal of replication 3, and a second broker
    // chosen so that each journal loses members but keeps one (a journal
    // whose every member dies keeps only what reached its store, and these
    // have none): of the other journal's route unless the first is in it.
    let (keys, _) = c.etcd_keys().await.expect("etcd answers");
    let first = keys["faults/r3"]
        .iter()
        .find(|(_, slot)| *slot == 0)
        .map(|(id, _)| id.clone())
        .expect("a primary");
    let r2: Vec<&String> = keys["faults/r2"].iter().map(|(id, _)| id).collect();
    let second = c
        .brokers
        .iter()
        .map(|b| b.id.clone())
        .find(|id| *id != first && r2.contains(&id) != r2.contains(&&first))
        .expect("a second broker");
    let killed = Instant::now();
    for id in [&first, &second] {
        let i = c.index(id);
        c.brokers[i].kill9();
    }
    watch_soundness(&c, Instant::now() + Duration::from_secs(6)).await;
    for id in [&first, &second] {
        let i = c.index(id);
        tokio::task::block_in_place(|| c.brokers[i].start());
    }
    let back = Instant::now();
    eprintln!(
        "{first} and {second} back {:?} after the kill",
        back - killed
    );
    check_healed(&c, &client, loads, back).await;
}
