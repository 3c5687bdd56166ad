//! End-to-end: store fragments that disagree with a journal's committed
//! history (PROTOCOL.md §7.1). A `file://` store is given, by hand, a
//! fragment over offsets the journal already holds, with other bytes and a
//! valid name, as a deposed primary's upload would be; the broker serves
//! the committed bytes, shows the other fragment as conflicting, counts and
//! logs it, and prune removes it. Where nothing tells which of two
//! fragments is committed, reads of their span are refused.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::store::TestStore;
use common::*;
use rotary_net::client::{Client, FragmentInfo};
use rotary_net::spec::{Codec, JournalSpec};
use rotary_net::wire::AppendRequest;
use rotary_net::Status;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on every wait for the broker to catch up (uploads, listings).
const WAIT: Duration = Duration::from_secs(30);
/// How often waits poll.
const POLL: Duration = Duration::from_millis(100);
/// Bytes of each fragment of the journal's real history.
const PART: usize = 4096;

fn spec(name: &str, store: &TestStore) -> JournalSpec {
    let mut spec = JournalSpec::new(name);
    spec.fragment.length = 1 << 20;
    spec.fragment.compression_codec = Codec::Gzip;
    spec.fragment.stores = vec![store.url()];
    spec.fragment.refresh_interval = Duration::from_secs(1);
    spec.labels
        .add("app".into(), "conflicts".into())
        .expect("label");
    spec
}

/// Bytes that differ from one seed to the next.
fn content(seed: u32, len: usize) -> Vec<u8> {
    record(seed, 3, len)
}

/// Appends `parts`, each sealed into a fragment of its own, and waits
/// until the store holds them all; returns the journal's bytes.
async fn history(client: &Client, store: &TestStore, j: &str, parts: &[Vec<u8>]) -> Vec<u8> {
    assert_eq!(client.apply(&[spec(j, store)]).await.unwrap(), 1);
    let mut all = Vec::new();
    for part in parts {
        let deadline = Instant::now() + WAIT;
        let r = loop {
            let req = AppendRequest {
                journal: j.to_string(),
                ..Default::default()
            };
            match client.append(&req, part.clone()).await {
                Ok(r) => break r,
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(POLL).await;
                }
                Err(e) => panic!("append to {j}: {e}"),
            }
        };
        assert_eq!(r.begin, all.len() as u64);
        all.extend_from_slice(part);
        client.seal(j).await.unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while store.fragments(j).len() < parts.len() {
        assert!(Instant::now() < deadline, "{j}: not uploaded");
        tokio::time::sleep(POLL).await;
    }
    all
}

/// Writes a fragment into the store by hand, named as the broker names
/// them (its bytes uncompressed); returns its key.
fn forge(store: &TestStore, j: &str, begin: u64, bytes: &[u8]) -> String {
    let TestStore::File { dir } = store else {
        unreachable!("a file store")
    };
    let end = begin + bytes.len() as u64;
    let key = format!("{j}/{begin:016x}-{end:016x}-{}.raw", hex_sha1(bytes));
    std::fs::write(dir.path().join(&key), bytes).unwrap();
    key
}

fn remove(store: &TestStore, key: &str) {
    let TestStore::File { dir } = store else {
        unreachable!("a file store")
    };
    std::fs::remove_file(dir.path().join(key)).unwrap();
}

/// Polls FRAGMENTS until the fragment of `key` is listed and `done`
/// holds of it, for at most [`WAIT`].
async fn wait_fragment(
    client: &Client,
    j: &str,
    key: &str,
    what: &str,
    done: impl Fn(&FragmentInfo) -> bool,
) -> FragmentInfo {
    let deadline = Instant::now() + WAIT;
    loop {
        let frags = client.fragments(j).await.expect("fragments");
        if let Some(f) = frags.iter().find(|f| f.key.as_deref() == Some(key)) {
            if done(f) {
                return f.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "{j}: {key} {what} not within {WAIT:?}; fragments: {frags:#?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

fn cli_bytes(broker: &Broker, args: &[&str]) -> Vec<u8> {
    let (code, out, err) = run_cli(broker.cli(args), b"");
    assert_eq!(code, 0, "rotary {args:?}: {err}");
    out
}

fn cli_ok(broker: &Broker, args: &[&str]) -> String {
    String::from_utf8(cli_bytes(broker, args)).unwrap()
}

/// `/metrics`, checked by `promtool`.
fn scrape_checked(http: &str) -> String {
    let text = scrape(http);
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's `prometheus` package)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// A fragment as a deposed primary would upload it: over the second of the
/// journal's fragments and part of the third, with other bytes, larger
/// than either (reads prefer larger fragments). The broker, holding no
/// local copies (`--local-cache 0`), compares their bytes, finds that the
/// chain of the real fragments reaches its write head and the forged one's
/// does not, and serves the committed bytes every way a client reads;
/// shows, counts and logs the forged one once; prune removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_off_the_committed_chain_is_never_served_and_is_pruned() {
    let store = TestStore::file();
    let http = format!("127.0.0.1:{}", free_port_range(1));
    let broker = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            args: ["--local-cache", "0", "--http", &http]
                .map(String::from)
                .to_vec(),
            ..Default::default()
        },
    );
    let client = broker.client().await;
    let j = "conflicts/chain";
    let parts = [content(1, PART), content(2, PART), content(3, PART)];
    let committed = history(&client, &store, j, &parts).await;
    let head = committed.len() as u64;
    let real: Vec<String> = store.fragments(j).into_iter().map(|f| f.key).collect();
    let forged_bytes = content(9, PART + PART / 2);
    let forged = forge(&store, j, PART as u64, &forged_bytes);

    // Listed (and judged) at the next listing.
    let f = wait_fragment(&client, j, &forged, "listed", |_| true).await;
    for (what, got) in [
        ("proxied", read_range(&client, j, 0, None).await.unwrap().0),
        ("direct", read_direct_fetching(&client, j).await),
        (
            "`rotary read --proxy`",
            cli_bytes(&broker, &["read", j, "--offset", "0", "--proxy"]),
        ),
        (
            "`rotary read`",
            cli_bytes(&broker, &["read", j, "--offset", "0"]),
        ),
    ] {
        assert_eq!(got.len(), committed.len(), "{what} read: length");
        assert_eq!(hex_sha1(&got), hex_sha1(&committed), "{what} read: SHA-1");
        assert!(got == committed, "{what} read: other bytes than committed");
    }
    // A read from inside the forged span, ending inside it.
    let (got, done) = read_range(&client, j, PART as u64 + 10, Some(2 * PART as u64 + 10))
        .await
        .unwrap();
    assert_eq!(
        (done.status, done.offset),
        (Status::OK, 2 * PART as u64 + 10)
    );
    assert!(
        got == committed[PART + 10..2 * PART + 10],
        "a read inside the span"
    );

    let why = f.conflicting.as_deref().expect("shown as conflicting");
    assert_eq!((f.begin, f.end), (PART as u64, PART as u64 * 5 / 2));
    assert!(f.disputed.is_none());
    assert!(
        real.iter().any(|k| why.contains(k.as_str())),
        "names the fragment it disagrees with: {why}"
    );
    let table = cli_ok(&broker, &["fragments", j]);
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("{} ", PART)) && l.contains(&hex_sha1(&forged_bytes)))
        .unwrap_or_else(|| panic!("no row for the forged fragment:\n{table}"));
    assert_eq!(row.split_whitespace().nth(6), Some("conflicting"), "{row}");
    assert_eq!(table.matches("conflicting").count(), 1, "{table}");
    let json = cli_ok(&broker, &["fragments", j, "-o", "json"]);
    let rows: Vec<FragmentInfo> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.iter().filter(|r| r.conflicting.is_some()).count(), 1);

    // Counted once, logged once, however many listings saw it since.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let stats = client.stats().await.unwrap();
    assert_eq!(stats["fragments_conflicting"], 1, "{stats}");
    let text = scrape_checked(&http);
    assert_eq!(counter(&text, "rotary_fragments_conflicting_total"), 1.0);
    let log = broker.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("disagrees with the journal's committed history"))
        .collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains("WARN") && warned[0].contains(&forged),
        "{}",
        warned[0]
    );

    // Prune: a dry run names it and leaves it; then it goes, and only it
    // (the journal's retention keeps everything else).
    let dry = cli_ok(
        &broker,
        &["journals", "prune", "-l", "app=conflicts", "--dry-run"],
    );
    assert_eq!(dry.lines().count(), 1, "{dry}");
    assert!(
        dry.starts_with(&format!(
            "would prune {j} [{PART}, {}) sha1={}",
            PART * 5 / 2,
            hex_sha1(&forged_bytes)
        )) && dry
            .trim_end()
            .ends_with(&format!("key={forged} conflicting")),
        "{dry}"
    );
    assert_eq!(
        store.fragments(j).len(),
        real.len() + 1,
        "a dry run deletes nothing"
    );
    let pruned = cli_ok(&broker, &["journals", "prune", "-l", "app=conflicts"]);
    assert!(
        pruned.starts_with(&format!("pruned {j} [{PART}, ")),
        "{pruned}"
    );
    let left: Vec<String> = store.fragments(j).into_iter().map(|f| f.key).collect();
    assert_eq!(left, real, "the store holds the real history alone");
    let deadline = Instant::now() + WAIT;
    while client
        .fragments(j)
        .await
        .unwrap()
        .iter()
        .any(|f| f.key.as_deref() == Some(forged.as_str()))
    {
        assert!(
            Instant::now() < deadline,
            "the pruned fragment stays listed"
        );
        tokio::time::sleep(POLL).await;
    }
    assert!(client
        .prune("app=conflicts", true)
        .await
        .unwrap()
        .is_empty());
    let (got, done) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(
        (done.status, done.offset, done.write_head),
        (Status::OK, head, head)
    );
    assert!(got == committed);
}

/// Two fragments over the same span with other bytes, both chaining to the
/// head, and no local copy: nothing tells which is committed. A read of
/// their span is refused IO_ERROR naming both, after the bytes before it;
/// neither is pruned. Once the operator removes the wrong one, reads are
/// whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_the_broker_cannot_tell_apart_are_refused_not_guessed() {
    let store = TestStore::file();
    let broker = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            args: ["--local-cache", "0"].map(String::from).to_vec(),
            ..Default::default()
        },
    );
    let client = broker.client().await;
    let j = "conflicts/undecided";
    let parts = [content(1, PART), content(2, PART), content(3, PART)];
    let committed = history(&client, &store, j, &parts).await;
    let second = store
        .fragments(j)
        .into_iter()
        .find(|f| f.begin == PART as u64)
        .expect("the second fragment")
        .key;
    let forged = forge(&store, j, PART as u64, &content(9, PART));

    let f = wait_fragment(&client, j, &forged, "disputed", |f| f.disputed.is_some()).await;
    assert!(f.conflicting.is_none());
    for _ in 0..2 {
        let (got, done) = read_range(&client, j, 0, None).await.unwrap();
        assert!(got == committed[..PART], "the bytes before the span");
        assert_eq!((done.status, done.offset), (Status::IO_ERROR, PART as u64));
        let msg = done.message.clone();
        assert!(msg.contains(&forged) && msg.contains(&second), "{msg}");
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    let table = cli_ok(&broker, &["fragments", j]);
    assert_eq!(table.matches(" disputed ").count(), 2, "{table}");
    assert!(client
        .prune("app=conflicts", false)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(client.stats().await.unwrap()["fragments_conflicting"], 0);

    remove(&store, &forged);
    let deadline = Instant::now() + WAIT;
    loop {
        let (got, done) = read_range(&client, j, 0, None).await.unwrap();
        if done.status == Status::OK {
            assert!(got == committed);
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {done:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// With the local copy of a fragment at hand, an object of the same span
/// with other bytes is conflicting: the broker's copy is committed history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_copy_outweighs_an_object_of_its_span() {
    let store = TestStore::file();
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "conflicts/local";
    let parts = [content(1, PART), content(2, PART)];
    let committed = history(&client, &store, j, &parts).await;
    let forged = forge(&store, j, PART as u64, &content(9, PART));
    let f = wait_fragment(&client, j, &forged, "conflicting", |f| {
        f.conflicting.is_some()
    })
    .await;
    let why = f.conflicting.unwrap();
    assert!(why.contains("this broker's copy of [4096, 8192)"), "{why}");
    assert!(read_range(&client, j, 0, None).await.unwrap().0 == committed);
    let pruned = client.prune("app=conflicts", false).await.unwrap();
    assert_eq!(pruned.len(), 1, "{pruned:?}");
    assert_eq!(pruned[0].key, forged);
    assert!(pruned[0].conflicting.is_some());
    assert_eq!(store.fragments(j).len(), parts.len());
}

/// A read the client serves itself from the stores' objects, where the
/// broker gives their locations; at least one must come from a store.
async fn read_direct_fetching(client: &Client, j: &str) -> Vec<u8> {
    let (bytes, fetched) = read_direct(client, j, 0).await;
    assert!(fetched > 0, "no fragment came from the store");
    bytes
}
