//! End-to-end: a journal deleted while its broker was down. The start
//! finds the journal's files and commit-log records with no spec, once the
//! spec source has been read (the broker's own store on a single node, the
//! cluster file with `--cluster`), and reaps them: the directory leaves
//! the data directory, the broker logs and counts it, the other journals
//! read back whole, and the journal created again starts empty at offset 0
//! with none of the deleted one's registers.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::cluster::Cluster;
use common::*;
use rand::{Rng, SeedableRng};
use rotary_net::client::Client;
use rotary_net::spec::{JournalSpec, LabelSet};
use rotary_net::wire::AppendRequest;
use std::path::Path;
use std::time::{Duration, Instant};

const GONE: &str = "e2e/deleted/gone";
const KEPT: &str = "e2e/deleted/kept";
/// How long a start may take to hand the deleted journal's files over.
const REAP_WAIT: Duration = Duration::from_secs(10);

/// Small fragments: each journal's directory holds sealed fragments and a
/// spool.
fn spec(name: &str) -> JournalSpec {
    let mut spec = JournalSpec::new(name);
    spec.fragment.length = 256 << 10;
    spec.fragment.compression_codec = rotary_net::spec::Codec::None;
    spec
}

/// Appends seeded bytes to `journal`, every append setting register
/// `owner` to the journal's name; returns every byte appended.
async fn fill(client: &Client, journal: &str, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut all = Vec::new();
    for _ in 0..24 {
        let mut bytes = vec![0u8; rng.gen_range(1..48 << 10)];
        rng.fill(&mut bytes[..]);
        let req = AppendRequest {
            journal: journal.to_string(),
            union_registers: LabelSet::from_pairs([("owner", journal)]).unwrap(),
            ..Default::default()
        };
        let r = client.append(&req, bytes.clone()).await.unwrap();
        assert_eq!(r.begin, all.len() as u64, "{journal}");
        all.extend_from_slice(&bytes);
    }
    all
}

/// Until the data directory holds no directory of `journal`.
async fn wait_reaped(data: &Path, journal: &str) {
    let give_up = Instant::now() + REAP_WAIT;
    while holds_files_of(data, journal) {
        assert!(
            Instant::now() < give_up,
            "{journal}'s files are still in {} after {REAP_WAIT:?}",
            data.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a start that reaped `GONE` shows: it said so, naming the journal,
/// and counted it; `KEPT` reads back every byte.
async fn assert_reaped(client: &Client, log: &str, kept: &[u8]) {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("reaping its files"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(&format!("journal={GONE} ")),
        "{}",
        lines[0]
    );
    let stats = client.stats().await.unwrap();
    assert_eq!(stats["recovery_reaped_journals"], 1, "{stats}");
    let got = read_all(client, KEPT).await;
    assert_eq!(got.len(), kept.len());
    assert_eq!(sha1(&got), sha1(kept), "{KEPT} reads back");
}

/// `GONE`, created again: nothing to read, appends start at offset 0, and
/// the registers are its own.
async fn assert_starts_empty(client: &Client) {
    assert_eq!(write_head(client, GONE).await, 0);
    let req = AppendRequest {
        journal: GONE.to_string(),
        ..Default::default()
    };
    let r = client.append(&req, b"anew".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (0, 4), "{r:?}");
    assert!(
        r.registers.is_empty(),
        "the deleted journal's registers: {r:?}"
    );
    assert_eq!(read_all(client, GONE).await, b"anew");
}

/// A single node: its specs are its own store's, which a start reads
/// before anything else. The journal is deleted through the store while
/// the broker is down, as a DELETE cut off by a crash after its spec went
/// leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_deleted_while_a_single_node_was_down_is_reaped_at_start() {
    let mut broker = Broker::start();
    let client = broker.client().await;
    for j in [GONE, KEPT] {
        client.apply(&[spec(j)]).await.unwrap();
    }
    fill(&client, GONE, 1).await;
    let kept = fill(&client, KEPT, 2).await;
    broker.stop_graceful();
    let specs = rotary_engine::specs::SpecStore::open(broker.data.join("specs.json")).unwrap();
    assert!(specs.delete(GONE).unwrap());
    drop(specs);
    assert!(holds_files_of(&broker.data, GONE));

    broker.start_again();
    wait_reaped(&broker.data, GONE).await;
    assert!(holds_files_of(&broker.data, KEPT));
    let client = broker.client().await;
    assert_reaped(&client, &broker.log(), &kept).await;
    create_journal(&client, GONE, |s| *s = spec(GONE)).await;
    assert_starts_empty(&client).await;
    // Nothing of it comes back at the next start.
    broker.restart();
    let client = broker.client().await;
    assert_eq!(read_all(&client, GONE).await, b"anew");
}

/// A broker of a cluster file, killed: the journal is taken out of the
/// file while it is down. Its start reads the file before any shard opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_taken_out_of_the_cluster_file_while_down_is_reaped_at_start() {
    let mut cluster = Cluster::start(1, CORES_DEFAULT);
    cluster.apply(&[spec(GONE), spec(KEPT)]).await;
    let client = cluster.brokers[0].client().await;
    fill(&client, GONE, 3).await;
    let kept = fill(&client, KEPT, 4).await;
    cluster.brokers[0].kill9();
    // No broker runs: the file changes under it.
    cluster.delete(GONE).await;
    assert!(cluster.brokers[0].holds_files_of(GONE));

    cluster.brokers[0].start();
    let b = &cluster.brokers[0];
    wait_reaped(&b.data, GONE).await;
    assert!(b.holds_files_of(KEPT));
    let client = b.client().await;
    assert_reaped(&client, &b.log(), &kept).await;
    cluster.apply(&[spec(GONE)]).await;
    assert_starts_empty(&cluster.brokers[0].client().await).await;
}
