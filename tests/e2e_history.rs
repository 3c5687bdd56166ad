//! End-to-end: history in fragment stores, against a `file://` directory
//! and a real S3 endpoint (moto). Sealed fragments are uploaded under their
//! content-addressed names and decode to the bytes appended; a broker that
//! lost its disk serves all history from the store (proxied, and directly
//! by clients) and refuses appends until its head is reset; retention
//! prunes; a store outage delays uploads without losing them; journals whose
//! names prefix each other keep apart.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::store::{StoredFragment, TestStore};
use common::*;
use rotary_net::client::{Client, FragmentInfo, ReadEvent, ReadOptions};
use rotary_net::spec::{Codec, JournalSpec};
use rotary_net::wire::{AppendReply, AppendRequest, ReadRequest};
use rotary_net::Status;
use std::time::{Duration, Instant};

/// Bound on every wait for the broker to catch up (uploads, listings).
const WAIT: Duration = Duration::from_secs(30);
/// How often waits poll.
const POLL: Duration = Duration::from_millis(100);

fn broker_for(store: &TestStore, args: &[&str]) -> Broker {
    Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            args: args.iter().map(|s| s.to_string()).collect(),
            env: store.broker_env(),
            ..Default::default()
        },
    )
}

fn spec(name: &str, store: &TestStore, codec: Codec, length: u64) -> JournalSpec {
    let mut spec = JournalSpec::new(name);
    spec.fragment.length = length;
    spec.fragment.compression_codec = codec;
    spec.fragment.stores = vec![store.url()];
    spec.fragment.refresh_interval = Duration::from_secs(1);
    spec
}

async fn apply(client: &Client, spec: &JournalSpec) {
    assert_eq!(client.apply(std::slice::from_ref(spec)).await.unwrap(), 1);
}

fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}

/// Appends, retrying retryable refusals (a journal with stores refuses
/// appends until its store was first listed) until [`WAIT`] runs out.
async fn append(client: &Client, journal: &str, bytes: &[u8]) -> AppendReply {
    let deadline = Instant::now() + WAIT;
    loop {
        match client.append(&req(journal), bytes.to_vec()).await {
            Ok(r) => {
                assert_eq!(r.end - r.begin, bytes.len() as u64);
                return r;
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(POLL).await;
            }
            Err(e) => panic!("append to {journal}: {e}"),
        }
    }
}

/// Content that compresses somewhat: text-like runs with random bytes.
fn content(seed: u32, len: usize) -> Vec<u8> {
    let noise = record(seed, 7, len);
    (0..len)
        .map(|i| {
            if (i / 64) % 2 == 0 {
                b"rotary history "[i % 15]
            } else {
                noise[i]
            }
        })
        .collect()
}

/// Polls FRAGMENTS until `done` holds, for at most [`WAIT`].
async fn wait_fragments(
    client: &Client,
    journal: &str,
    what: &str,
    done: impl Fn(&[FragmentInfo]) -> bool,
) -> Vec<FragmentInfo> {
    let deadline = Instant::now() + WAIT;
    loop {
        let frags = client.fragments(journal).await.expect("fragments");
        if done(&frags) {
            return frags;
        }
        assert!(
            Instant::now() < deadline,
            "{journal}: {what} not within {WAIT:?}; fragments: {frags:#?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

fn local(frags: &[FragmentInfo]) -> Vec<&FragmentInfo> {
    frags.iter().filter(|f| f.store == "local").collect()
}

fn stored(frags: &[FragmentInfo]) -> Vec<&FragmentInfo> {
    frags.iter().filter(|f| f.store != "local").collect()
}

/// Every sealed local fragment uploaded (and no open spool left).
fn all_uploaded(frags: &[FragmentInfo]) -> bool {
    let l = local(frags);
    !l.is_empty() && l.iter().all(|f| !f.open && f.uploaded == Some(true))
}

/// Polls the store until its objects for `journal` cover `[0, head)`.
async fn wait_store_covers(store: &TestStore, journal: &str, head: u64) -> Vec<StoredFragment> {
    let deadline = Instant::now() + WAIT;
    loop {
        let frags = store.fragments(journal);
        if covers(&frags, head) {
            return frags;
        }
        assert!(
            Instant::now() < deadline,
            "{journal}: store objects do not cover [0, {head}) within {WAIT:?}: {:?}",
            frags
                .iter()
                .map(|f| (&f.key, f.begin, f.end))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Whether fragments chain from 0 to `head` without gaps (overlaps allowed:
/// a larger fragment may cover smaller ones).
fn covers(frags: &[StoredFragment], head: u64) -> bool {
    let mut at = 0;
    for f in frags {
        if f.begin > at {
            return false;
        }
        at = at.max(f.end);
    }
    at >= head
}

/// Checks each object's bytes against what was appended.
fn check_against(frags: &[StoredFragment], expected: &[u8]) {
    for f in frags {
        assert!(
            f.end as usize <= expected.len(),
            "{} beyond the head",
            f.key
        );
        assert!(
            f.bytes == expected[f.begin as usize..f.end as usize],
            "{}: bytes differ from those appended at [{}, {})",
            f.key,
            f.begin,
            f.end
        );
    }
}

/// A proxied read of `[from, head)`; `None` while the broker answers
/// that there is nothing there yet.
async fn read_proxied(client: &Client, journal: &str, from: u64) -> Vec<u8> {
    let (bytes, done) = read_range(client, journal, from, None).await.unwrap();
    assert!(
        matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE),
        "{done:?}"
    );
    bytes
}

fn cli_ok(broker: &Broker, args: &[&str]) -> Vec<u8> {
    let (code, out, err) = run_cli(broker.cli(args), b"");
    assert_eq!(code, 0, "rotary {args:?}: {err}");
    out
}

// ---------------------------------------------------------------------------
// Uploads: names, codecs, contents.

async fn uploads_every_codec(store: TestStore) {
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    let codecs = [Codec::None, Codec::Gzip, Codec::Zstd, Codec::Snappy];
    let mut expected = Vec::new();
    for (i, codec) in codecs.iter().enumerate() {
        let name = format!("hist/codec-{i}");
        apply(&client, &spec(&name, &store, *codec, 4096)).await;
        // Fragments seal by length (4 KiB) as appends arrive, and once more
        // by an explicit seal.
        let mut bytes = Vec::new();
        for k in 0..8 {
            let c = content(i as u32 * 100 + k, 1500 + 97 * k as usize);
            let r = append(&client, &name, &c).await;
            assert_eq!(r.begin, bytes.len() as u64);
            bytes.extend_from_slice(&c);
        }
        client.seal(&name).await.unwrap();
        expected.push((name, *codec, bytes));
    }
    for (name, codec, bytes) in &expected {
        let head = bytes.len() as u64;
        let frags = wait_fragments(&client, name, "uploads", all_uploaded).await;
        let locals = local(&frags);
        assert!(locals.len() >= 3, "{name}: {locals:?}");
        let objects = wait_store_covers(&store, name, head).await;
        check_against(&objects, bytes);
        // Every sealed local fragment is in the store under its exact name.
        for l in &locals {
            let o = objects
                .iter()
                .find(|o| (o.begin, o.end) == (l.begin, l.end))
                .unwrap_or_else(|| panic!("{name}: local {l:?} not in the store"));
            assert_eq!(o.sha1, l.sha1);
            assert_eq!(o.codec, *codec);
            assert_eq!(
                o.key,
                format!(
                    "{name}/{:016x}-{:016x}-{}{}",
                    l.begin,
                    l.end,
                    l.sha1,
                    codec.extension()
                )
            );
        }
        // The broker lists the store: FRAGMENTS shows each object with its
        // key, codec and stored size.
        let frags = wait_fragments(&client, name, "store listing", |f| {
            stored(f).len() >= objects.len()
        })
        .await;
        for o in &objects {
            let s = stored(&frags)
                .into_iter()
                .find(|s| (s.begin, s.end) == (o.begin, o.end))
                .unwrap_or_else(|| panic!("{name}: {} not listed: {frags:#?}", o.key));
            assert_eq!(s.store, store.url());
            assert_eq!(s.sha1, o.sha1);
            assert_eq!(s.codec, *codec);
            assert_eq!(s.size, o.size, "{}: size is the stored size", o.key);
            let key = s.key.as_deref().expect("store fragments have a key");
            assert!(key.ends_with(&o.key), "{key} vs {}", o.key);
            assert!(s.mod_time > 0);
        }
        // Proxied and direct reads agree with what was appended (here the
        // broker still has every fragment on its disk).
        assert_eq!(read_proxied(&client, name, 0).await, *bytes);
        assert_eq!(read_direct(&client, name, 0).await.0, *bytes);
    }

    // The CLI table shows ranges, SHA-1s, codecs, sizes, states and stores.
    let (name, _, _) = &expected[2];
    let table = String::from_utf8(cli_ok(&broker, &["fragments", name])).unwrap();
    let header = table.lines().next().unwrap();
    for col in [
        "BEGIN", "END", "SHA1", "CODEC", "SIZE", "STATE", "AGE", "STORE",
    ] {
        assert!(header.contains(col), "{header}");
    }
    assert!(table.contains(" zstd "), "{table}");
    assert!(table.contains(" uploaded "), "{table}");
    assert!(table.contains(" stored "), "{table}");
    assert!(table.contains(&store.url()), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_uploads_every_codec() {
    uploads_every_codec(TestStore::file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_uploads_every_codec() {
    uploads_every_codec(TestStore::s3("uploads/")).await;
}

// ---------------------------------------------------------------------------
// A broker that lost its disk: history from the store, then reset-head.

async fn wiped_broker_serves_history(store: TestStore, codec: Codec) {
    let name = "hist/wiped";
    let spec = spec(name, &store, codec, 16 << 10);
    let mut broker = broker_for(&store, &[]);
    let mut expected = Vec::new();
    {
        let client = broker.client().await;
        apply(&client, &spec).await;
        for k in 0..30u32 {
            let c = content(k, 1000 + 131 * k as usize);
            let r = append(&client, name, &c).await;
            assert_eq!(r.begin, expected.len() as u64);
            expected.extend_from_slice(&c);
            if k == 12 {
                cli_ok(&broker, &["journals", "seal", name]);
            }
        }
        // The tail stays in the open spool: the graceful shutdown seals and
        // uploads it.
        let frags = client.fragments(name).await.unwrap();
        assert!(frags.iter().any(|f| f.open), "{frags:?}");
    }
    broker.stop_graceful();
    let head = expected.len() as u64;
    let objects = wait_store_covers(&store, name, head).await;
    check_against(&objects, &expected);

    broker.wipe_data();
    broker.start_again();
    let client = broker.client().await;
    apply(&client, &spec).await;
    // FRAGMENTS waits for the first listing: the stored history at once,
    // not an empty journal.
    let frags = client.fragments(name).await.unwrap();
    let covered: u64 = frags.iter().map(|f| f.end - f.begin).sum();
    assert!(
        covered >= head && frags.iter().all(|f| f.store != "local"),
        "{frags:?}"
    );

    // History is readable at its offsets once the store is listed.
    let deadline = Instant::now() + WAIT;
    let proxied = loop {
        let bytes = read_proxied(&client, name, 0).await;
        if bytes.len() as u64 >= head || Instant::now() > deadline {
            break bytes;
        }
        tokio::time::sleep(POLL).await;
    };
    assert!(
        proxied == expected,
        "proxied history differs ({} bytes)",
        proxied.len()
    );
    let (direct, fetched) = read_direct(&client, name, 0).await;
    assert!(
        direct == expected,
        "direct history differs ({} bytes)",
        direct.len()
    );
    assert!(fetched >= 1, "no fragment was fetched from the store");
    // A proxied read of history held only in the store reports where the
    // history ends as the write head, not this broker's own (lower) head.
    let mut s = client
        .read(
            &ReadRequest {
                journal: name.to_string(),
                offset: Some(0),
                end_offset: Some(head / 2),
                route_revision: 0,
            },
            false,
            false,
        )
        .await
        .unwrap();
    let done = loop {
        match s.next().await.expect("READ_DONE").unwrap() {
            ReadEvent::Done(d) => break d,
            _ => continue,
        }
    };
    assert_eq!(
        (done.status, done.offset, done.write_head),
        (Status::OK, head / 2, head)
    );
    // From the middle of a fragment, too.
    let mid = objects[objects.len() / 2].begin + 7;
    assert!(read_direct(&client, name, mid).await.0 == expected[mid as usize..]);
    assert!(read_proxied(&client, name, mid).await == expected[mid as usize..]);

    // A raw DO_NOT_PROXY read answers with the location, then READ_DONE at
    // the fragment's end.
    let r = ReadRequest {
        journal: name.to_string(),
        offset: Some(mid),
        end_offset: None,
        route_revision: 0,
    };
    let options = ReadOptions {
        do_not_proxy: true,
        ..Default::default()
    };
    let mut s = client.read_with(&r, options).await.unwrap();
    let first = s.next().await.unwrap().unwrap();
    let ReadEvent::Fragment {
        begin,
        end,
        offset,
        sha1,
        codec: got_codec,
        location,
    } = first
    else {
        panic!("expected READ_FRAGMENT, got {first:?}");
    };
    let o = objects
        .iter()
        .find(|o| (o.begin, o.end) == (begin, end))
        .unwrap_or_else(|| panic!("READ_FRAGMENT [{begin}, {end}) is no stored object"));
    assert!(begin <= mid && mid < end);
    assert_eq!(offset, mid);
    assert_eq!(hex::encode(sha1), o.sha1);
    assert_eq!(got_codec, codec);
    let scheme = if store.is_s3() { "http://" } else { "file://" };
    assert!(location.starts_with(scheme), "{location}");
    match s.next().await.unwrap().unwrap() {
        ReadEvent::Done(d) => assert_eq!((d.status, d.offset), (Status::OK, end)),
        other => panic!("expected READ_DONE, got {other:?}"),
    }

    // The CLI reads directly by default and through the broker with --proxy.
    let out = cli_ok(&broker, &["read", name]);
    assert!(out == expected, "rotary read: {} bytes", out.len());
    let out = cli_ok(&broker, &["read", name, "--proxy"]);
    assert!(out == expected, "rotary read --proxy: {} bytes", out.len());

    // Appends are refused until the head is reset.
    let deadline = Instant::now() + WAIT;
    let err = loop {
        match client.append(&req(name), b"too early".to_vec()).await {
            Ok(r) => panic!("append before reset-head committed at {r:?}"),
            Err(e) if e.status() == Some(Status::FRAGMENT_STORE_UNHEALTHY) => {
                assert!(Instant::now() < deadline, "store never listed: {e}");
                tokio::time::sleep(POLL).await;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        err.status(),
        Some(Status::INDEX_HAS_GREATER_OFFSET),
        "{err}"
    );
    let reply = err
        .append_reply()
        .expect("the refusal carries the write head");
    assert!(reply.write_head < head, "{reply:?}");
    // A read "from the head" starts at the end of the history, not at
    // the lower head appends are refused at: a tail of new data does not
    // replay the store.
    let out = cli_ok(&broker, &["read", name, "--offset", "head", "--metadata"]);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v, serde_json::json!({"offset": head, "write_head": head}));

    let out = cli_ok(&broker, &["journals", "reset-head", name]);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v, serde_json::json!({"journal": name, "write_head": head}));

    // The new head outlives a crash before the next append.
    drop(client);
    tokio::task::block_in_place(|| broker.restart());
    let client = broker.client().await;
    let r = append(&client, name, b"after the reset").await;
    assert_eq!((r.begin, r.end), (head, head + 15));
    expected.extend_from_slice(b"after the reset");
    assert!(read_proxied(&client, name, 0).await == expected);
    assert!(read_direct(&client, name, 0).await.0 == expected);
    let out = cli_ok(&broker, &["read", name]);
    assert!(out == expected);

    // A blocking direct read crosses from store history to the live head
    // and keeps tailing it.
    let r = ReadRequest {
        journal: name.to_string(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    };
    let mut tail = client.read_direct(&r, true);
    let mut got = Vec::new();
    let mut appended = false;
    while got.len() < expected.len() + 6 {
        if got.len() == expected.len() && !appended {
            append(&client, name, b"live!\n").await;
            appended = true;
        }
        let ev = tokio::time::timeout(WAIT, tail.next())
            .await
            .expect("the tail is woken")
            .expect("an event")
            .expect("direct tail");
        match ev {
            ReadEvent::Data { offset, content } => {
                assert_eq!(offset, got.len() as u64, "contiguous");
                got.extend_from_slice(&content);
            }
            other => panic!("a blocking read ended: {other:?}"),
        }
    }
    expected.extend_from_slice(b"live!\n");
    assert!(got == expected, "tail differs");
    assert!(
        tail.stats()
            .fragments_fetched
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_wiped_broker_serves_history() {
    wiped_broker_serves_history(TestStore::file(), Codec::Gzip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_wiped_broker_serves_history() {
    wiped_broker_serves_history(TestStore::s3("wiped/"), Codec::Zstd).await;
}

// ---------------------------------------------------------------------------
// Retention.

async fn prune_removes_old_fragments(store: TestStore) {
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    let (old, kept) = ("prune/short", "prune/forever");
    let mut s = spec(old, &store, Codec::Snappy, 4096);
    s.labels.add("app".into(), "prune".into()).unwrap();
    s.fragment.retention = Duration::from_secs(1);
    apply(&client, &s).await;
    let mut s = spec(kept, &store, Codec::Snappy, 4096);
    s.labels.add("app".into(), "prune".into()).unwrap();
    apply(&client, &s).await;
    for j in [old, kept] {
        for k in 0..3 {
            append(&client, j, &content(k, 5000)).await;
        }
        client.seal(j).await.unwrap();
        wait_fragments(&client, j, "uploads", all_uploaded).await;
    }
    let before_old = wait_store_covers(&store, old, 15_000).await;
    let before_kept = wait_store_covers(&store, kept, 15_000).await;
    // Older than the 1 s retention.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let out = cli_ok(
        &broker,
        &[
            "journals",
            "prune",
            "-l",
            "app=prune",
            "--dry-run",
            "-o",
            "json",
        ],
    );
    let dry: Vec<serde_json::Value> = serde_json::from_slice(&out).unwrap();
    let mut dry_ranges: Vec<(u64, u64)> = dry
        .iter()
        .map(|p| {
            assert_eq!(p["journal"], old, "{p}");
            assert_eq!(p["store"], store.url().as_str());
            assert!(p["age_secs"].as_u64().unwrap() >= 1, "{p}");
            let key = p["key"].as_str().unwrap();
            let o = before_old
                .iter()
                .find(|o| key.ends_with(&o.key))
                .unwrap_or_else(|| panic!("{key} is no stored object"));
            assert_eq!(p["sha1"], o.sha1.as_str());
            (p["begin"].as_u64().unwrap(), p["end"].as_u64().unwrap())
        })
        .collect();
    dry_ranges.sort();
    let want: Vec<(u64, u64)> = before_old.iter().map(|o| (o.begin, o.end)).collect();
    assert_eq!(dry_ranges, want);
    // A dry run removes nothing.
    assert_eq!(store.list(&format!("{old}/")).len(), before_old.len());

    let out =
        String::from_utf8(cli_ok(&broker, &["journals", "prune", "-l", "app=prune"])).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), before_old.len(), "{out}");
    for o in &before_old {
        let line = lines
            .iter()
            .find(|l| l.contains(&format!("sha1={}", o.sha1)))
            .unwrap_or_else(|| panic!("{} not reported pruned: {out}", o.key));
        assert!(
            line.starts_with(&format!("pruned {old} [{}, {})", o.begin, o.end)),
            "{line}"
        );
    }
    assert!(
        store.list(&format!("{old}/")).is_empty(),
        "pruned objects remain"
    );
    assert_eq!(
        store.fragments(kept).len(),
        before_kept.len(),
        "retention 0s keeps all"
    );
    // The broker's index lets go of them too.
    wait_fragments(&client, old, "pruned fragments to leave the index", |f| {
        stored(f).is_empty()
    })
    .await;
    // Nothing left to prune.
    assert!(client.prune("app=prune", false).await.unwrap().is_empty());
    // The journal still reads in full from the broker's local fragments.
    assert_eq!(read_proxied(&client, old, 0).await.len(), 15_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_prune_removes_old_fragments() {
    prune_removes_old_fragments(TestStore::file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_prune_removes_old_fragments() {
    prune_removes_old_fragments(TestStore::s3("prune/")).await;
}

// ---------------------------------------------------------------------------
// Journals whose names prefix each other.

async fn prefixed_names_keep_apart(store: TestStore) {
    let (parent, child) = ("pre/fix", "pre/fix/child");
    let mut broker = broker_for(&store, &[]);
    let specs = [
        spec(parent, &store, Codec::Zstd, 4096),
        spec(child, &store, Codec::Zstd, 4096),
    ];
    let mut expected = [Vec::new(), Vec::new()];
    {
        let client = broker.client().await;
        for s in &specs {
            apply(&client, s).await;
        }
        for k in 0..6u32 {
            for (i, j) in [parent, child].iter().enumerate() {
                let c = content(1000 * i as u32 + k, 2500 + 300 * i);
                append(&client, j, &c).await;
                expected[i].extend_from_slice(&c);
            }
        }
        for (i, j) in [parent, child].iter().enumerate() {
            client.seal(j).await.unwrap();
            wait_fragments(&client, j, "uploads", all_uploaded).await;
            let objects = wait_store_covers(&store, j, expected[i].len() as u64).await;
            check_against(&objects, &expected[i]);
            // The store listing each journal sees is its own.
            let frags = wait_fragments(&client, j, "store listing", |f| {
                stored(f).len() >= objects.len()
            })
            .await;
            for s in stored(&frags) {
                let key = s.key.as_deref().unwrap();
                let rest = &key
                    [key.find(&format!("{j}/")).expect("key under the journal") + j.len() + 1..];
                assert!(!rest.contains('/'), "{j} lists {key}");
                assert!(s.end <= expected[i].len() as u64, "{j} lists {key}");
            }
        }
    }
    // From the store alone, each journal reads back exactly its own bytes.
    broker.stop_graceful();
    broker.wipe_data();
    broker.start_again();
    let client = broker.client().await;
    for s in &specs {
        apply(&client, s).await;
    }
    for (i, j) in [parent, child].iter().enumerate() {
        let want = &expected[i];
        let deadline = Instant::now() + WAIT;
        let got = loop {
            let bytes = read_proxied(&client, j, 0).await;
            if bytes.len() >= want.len() || Instant::now() > deadline {
                break bytes;
            }
            tokio::time::sleep(POLL).await;
        };
        assert!(
            got == *want,
            "{j}: {} bytes read, {} appended",
            got.len(),
            want.len()
        );
        assert!(read_direct(&client, j, 0).await.0 == *want, "{j}: direct");
        let frags = client.fragments(j).await.unwrap();
        let objects = store.fragments(j);
        let mut listed: Vec<(u64, u64)> = stored(&frags).iter().map(|f| (f.begin, f.end)).collect();
        listed.sort();
        let mut own: Vec<(u64, u64)> = objects.iter().map(|o| (o.begin, o.end)).collect();
        own.sort();
        assert_eq!(listed, own, "{j}: index is exactly its own objects");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_prefixed_names_keep_apart() {
    prefixed_names_keep_apart(TestStore::file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_prefixed_names_keep_apart() {
    prefixed_names_keep_apart(TestStore::s3("prefix/")).await;
}

// ---------------------------------------------------------------------------
// A gap in the history.

/// Appends `AAAA` and `BBBB` to `j` as two stored fragments, then removes
/// the first from the store and waits until the broker's listing lacks
/// it: `[0, 4)` is a gap. Returns the removed object's path and bytes.
async fn gap_at_the_start(
    client: &Client,
    store: &TestStore,
    j: &str,
) -> (std::path::PathBuf, Vec<u8>) {
    apply(client, &spec(j, store, Codec::None, 1 << 20)).await;
    append(client, j, b"AAAA").await;
    client.seal(j).await.unwrap();
    wait_store_covers(store, j, 4).await;
    append(client, j, b"BBBB").await;
    client.seal(j).await.unwrap();
    let frags = wait_store_covers(store, j, 8).await;
    let first = frags.iter().find(|f| f.begin == 0).expect("first fragment");
    let TestStore::File { dir } = store else {
        unreachable!()
    };
    let path = dir.path().join(&first.key);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    // Once the broker lists the store again, [0, 4) is a gap.
    let deadline = Instant::now() + WAIT;
    while client
        .fragments(j)
        .await
        .unwrap()
        .iter()
        .any(|f| f.begin == 0)
    {
        assert!(Instant::now() < deadline, "the lost fragment stays listed");
        tokio::time::sleep(POLL).await;
    }
    (path, bytes)
}

/// A fragment lost from the store leaves a gap. Once it is older than
/// `--offset-jump-age` (here zero), a read whose range ends in it ends
/// cleanly (the broker keeps serving), a read across it jumps it, and the
/// CLI warns about the missing offsets wherever they are in the range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_gap_in_history_is_read_around() {
    let store = TestStore::file();
    let http = format!("127.0.0.1:{}", free_port_range(1));
    let args = [
        "--local-cache",
        "0",
        "--offset-jump-age",
        "0s",
        "--http",
        &http,
    ];
    let broker = broker_for(&store, &args);
    let client = broker.client().await;
    let j = "hist/gap";
    gap_at_the_start(&client, &store, j).await;

    // A range inside the gap: no bytes, READ_DONE OK at its end.
    let (bytes, done) = read_range(&client, j, 0, Some(3)).await.unwrap();
    assert!(bytes.is_empty());
    assert_eq!((done.status, done.offset), (Status::OK, 3));
    client.ping().await.expect("the broker still serves");
    // The CLI says what is missing, at the start and at the end.
    for (args, out, warning) in [
        (
            vec!["read", j, "--offset", "0", "--proxy"],
            &b"BBBB"[..],
            "0..4",
        ),
        (
            vec!["read", j, "--offset", "0", "--end-offset", "3", "--proxy"],
            &b""[..],
            "0..3",
        ),
        (
            vec!["read", j, "--offset", "4", "--proxy"],
            &b"BBBB"[..],
            "",
        ),
    ] {
        let (code, stdout, err) = run_cli(broker.cli(&args), b"");
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_eq!(stdout, out, "{args:?}");
        if warning.is_empty() {
            assert!(err.is_empty(), "{args:?}: {err}");
        } else {
            assert_eq!(
                err,
                format!(
                    "warning: offsets {warning} are missing from the journal's history ({} bytes skipped)\n",
                    span_len(warning)
                ),
                "{args:?}"
            );
        }
    }
    let m = scrape(&http);
    assert!(counter(&m, "rotary_offset_jumps_total") >= 1.0, "{m}");
    assert!(counter(&m, "rotary_offset_jump_bytes_total") >= 4.0, "{m}");
}

/// The length of `a..b`.
fn span_len(range: &str) -> u64 {
    let (a, b) = range.split_once("..").unwrap();
    b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap()
}

/// A gap younger than `--offset-jump-age` (the default, six hours) may
/// still be filled, so no read skips it: a non-blocking read at the gap
/// answers OFFSET_NOT_YET_AVAILABLE at its offset, and a blocking one
/// waits, and reads the bytes once the fragment is back in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_young_gap_is_waited_for_not_jumped() {
    let store = TestStore::file();
    let http = format!("127.0.0.1:{}", free_port_range(1));
    let broker = broker_for(&store, &["--local-cache", "0", "--http", &http]);
    let client = broker.client().await;
    let j = "hist/young-gap";
    let (path, bytes) = gap_at_the_start(&client, &store, j).await;

    let (got, done) = read_range(&client, j, 0, None).await.unwrap();
    assert!(
        got.is_empty(),
        "a non-blocking read skipped the gap: {got:?}"
    );
    assert_eq!(
        (done.status, done.offset, done.write_head),
        (Status::OFFSET_NOT_YET_AVAILABLE, 0, 8)
    );
    // The CLI, not blocking, prints nothing of the journal and no jump.
    let (code, stdout, err) = run_cli(broker.cli(&["read", j, "--offset", "0", "--proxy"]), b"");
    assert_eq!((code, stdout.as_slice()), (0, &b""[..]), "{err}");
    assert!(!err.contains("missing"), "{err}");

    let req = ReadRequest {
        journal: j.to_string(),
        offset: Some(0),
        end_offset: Some(8),
        route_revision: 0,
    };
    let blocking = ReadOptions {
        block: true,
        ..ReadOptions::default()
    };
    let stream = client.read_with(&req, blocking).await.unwrap();
    let reader = tokio::spawn(read_to_done(stream, "blocking read", 0));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!reader.is_finished(), "the blocking read did not wait");
    std::fs::write(&path, &bytes).unwrap();
    let (got, done) = tokio::time::timeout(WAIT, reader)
        .await
        .expect("the read ends once the fragment is listed again")
        .unwrap()
        .unwrap();
    assert_eq!(
        (got.as_slice(), done.status),
        (&b"AAAABBBB"[..], Status::OK)
    );
    let m = scrape(&http);
    assert_eq!(counter(&m, "rotary_offset_jumps_total"), 0.0, "{m}");
}

/// A spec changed while its journal sees no requests still reaches the
/// journal: here a shorter flush interval, which seals and uploads the
/// open spool with nothing else asking for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_changed_spec_reaches_a_quiet_journal() {
    let store = TestStore::file();
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    let j = "hist/quiet";
    let mut s = spec(j, &store, Codec::None, 1 << 20);
    apply(&client, &s).await;
    let r = append(&client, j, b"quiet bytes").await;
    // The default flush interval (6h) does not seal it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(store.fragments(j).is_empty(), "sealed before the change");
    s.fragment.flush_interval = Duration::from_secs(1);
    apply(&client, &s).await;
    // Nothing but the broker's own clock from here on.
    let frags = wait_store_covers(&store, j, r.end).await;
    check_against(&frags, b"quiet bytes");
}

/// An object already bearing a fragment's name is read back before the
/// local copy is let go: one that holds other bytes (here written by hand)
/// is replaced, never trusted for its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_an_object_in_the_way_is_replaced() {
    let store = TestStore::file();
    let broker = broker_for(&store, &["--local-cache", "0"]);
    let client = broker.client().await;
    let j = "hist/in-the-way";
    apply(&client, &spec(j, &store, Codec::None, 1 << 20)).await;
    let r = append(&client, j, b"important data").await;
    let name = format!(
        "{:016x}-{:016x}-{}.raw",
        r.begin,
        r.end,
        hex_sha1(b"important data")
    );
    let TestStore::File { dir } = &store else {
        unreachable!()
    };
    let object = dir.path().join(j).join(&name);
    std::fs::create_dir_all(object.parent().unwrap()).unwrap();
    std::fs::write(&object, b"garbage garbage").unwrap();
    client.seal(j).await.unwrap();
    wait_fragments(&client, j, "the local copy dropped", |f| {
        local(f).is_empty()
    })
    .await;
    assert_eq!(std::fs::read(&object).unwrap(), b"important data");
    assert_eq!(read_proxied(&client, j, 0).await, b"important data");
}

/// A journal deleted while its fragment is still uploading, and created
/// again at once: the new journal lists its store only once that upload
/// ended, so it either holds the old history (appends refused until a
/// reset-head) or starts empty; never are two journals' bytes mixed, and a
/// read never returns the old bytes at offsets acknowledged to the new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_journal_created_again_keeps_its_own_bytes() {
    let store = TestStore::file();
    let broker = broker_for(&store, &["--local-cache", "0"]);
    let client = broker.client().await;
    let j = "hist/again";
    let s = spec(j, &store, Codec::Gzip, 64 << 20);
    apply(&client, &s).await;
    // Large enough that its upload is still running at the delete.
    let old = content(2, 24 << 20);
    for chunk in old.chunks(4 << 20) {
        append(&client, j, chunk).await;
    }
    client.seal(j).await.unwrap();
    client.delete(j).await.unwrap();
    apply(&client, &s).await;
    let new = content(1, old.len());
    let deadline = Instant::now() + WAIT;
    let appended = loop {
        match client.append(&req(j), new.clone()).await {
            Ok(r) => break Ok(r),
            Err(e) if e.status() == Some(Status::INDEX_HAS_GREATER_OFFSET) => break Err(e),
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(POLL).await;
            }
            Err(e) => panic!("append to the new journal: {e}"),
        }
    };
    // Whatever the store holds, once every upload ended and a listing
    // followed, the journal reads as one history.
    match appended {
        Ok(r) => {
            assert_eq!((r.begin, r.end), (0, new.len() as u64));
            client.seal(j).await.unwrap();
            wait_fragments(&client, j, "the local copy dropped", |f| {
                local(f).is_empty() && !stored(f).is_empty()
            })
            .await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let got = read_proxied(&client, j, 0).await;
            assert!(
                got == new,
                "the new journal reads other bytes than it was given"
            );
        }
        Err(_) => {
            let got = read_proxied(&client, j, 0).await;
            assert!(got == old, "the old history reads back whole");
        }
    }
}

/// A store object that does not hold the bytes its name says is found out
/// even by a read that ends inside it (the rest of it is read to check it),
/// and leaves the index: reads then use the good fragments beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_corrupt_fragment_is_never_served() {
    let store = TestStore::file();
    let broker = broker_for(&store, &["--local-cache", "0"]);
    let client = broker.client().await;
    let j = "hist/corrupt";
    apply(&client, &spec(j, &store, Codec::None, 1 << 20)).await;
    for part in [b"AAAA", b"BBBB"] {
        append(&client, j, part).await;
        client.seal(j).await.unwrap();
    }
    wait_store_covers(&store, j, 8).await;
    wait_fragments(&client, j, "the local copies dropped", |f| {
        local(f).is_empty()
    })
    .await;
    // A larger fragment, preferred by reads, whose bytes differ from its
    // name's SHA-1.
    let TestStore::File { dir } = &store else {
        unreachable!()
    };
    let name = format!("{:016x}-{:016x}-{}.raw", 0, 8, hex_sha1(b"AAAABBBB"));
    std::fs::write(dir.path().join(j).join(name), b"AAAABBBX").unwrap();
    wait_fragments(&client, j, "the corrupt object listed", |f| {
        f.iter().any(|f| f.begin == 0 && f.end == 8)
    })
    .await;
    let (bytes, done) = read_range(&client, j, 0, Some(2)).await.unwrap();
    assert_eq!(
        done.status,
        Status::FRAGMENT_STORE_UNHEALTHY,
        "a read ending inside the corrupt fragment: {bytes:?}, {done:?}"
    );
    // Out of the index, now and after later listings.
    for _ in 0..2 {
        assert_eq!(read_proxied(&client, j, 0).await, b"AAAABBBB");
        assert!(!client
            .fragments(j)
            .await
            .unwrap()
            .iter()
            .any(|f| f.begin == 0 && f.end == 8));
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
}

/// A local fragment whose file was damaged before its upload: the upload
/// finds that its bytes do not hash to its name and stops, and from then
/// on no read is served from that file (before, it is: reads of local
/// files are not checked). Its span answers IO_ERROR naming it; the rest
/// of the journal reads as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_damaged_local_fragment_is_not_read_again() {
    let store = TestStore::file();
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    let j = "hist/damaged-local";
    apply(&client, &spec(j, &store, Codec::None, 1 << 30)).await;
    // Larger than the in-memory tail, so that its start is read from disk.
    let first = content(31, 10 << 20);
    append(&client, j, &first).await;
    let spool = broker
        .data
        .join(format!(
            "shard-{}",
            rotary_net::shard_of(j, broker.cores as u32)
        ))
        .join(format!("journals/{j}/@/0000000000000000.spool"));
    // One byte of the committed bytes changed on disk, behind the broker.
    let at = 4096 + 100;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&spool)
            .unwrap();
        f.write_all_at(&[first[at] ^ 0xff], at as u64).unwrap();
        f.sync_all().unwrap();
    }
    client.seal(j).await.unwrap();
    let second = content(32, 5000);
    let r = append(&client, j, &second).await;
    assert_eq!(r.begin, first.len() as u64);
    // Until the upload ran, the file is read (its damage unknown); once it
    // ran, the span is refused.
    let deadline = Instant::now() + WAIT;
    let done = loop {
        let (bytes, done) = read_range(&client, j, 0, Some(8192)).await.unwrap();
        if done.status != Status::OK {
            assert!(bytes.is_empty(), "{} bytes before the refusal", bytes.len());
            break done;
        }
        assert!(
            Instant::now() < deadline,
            "reads of the damaged span never refused; damaged bytes served: {}",
            bytes != first[..bytes.len()]
        );
        tokio::time::sleep(POLL).await;
    };
    assert_eq!(done.status, Status::IO_ERROR, "{done:?}");
    assert_eq!(done.offset, 0, "{done:?}");
    assert!(
        done.message.contains(".raw") && done.message.contains("hash to"),
        "the message names the file and the damage: {}",
        done.message
    );
    // FRAGMENTS says so.
    let frags = client.fragments(j).await.unwrap();
    let damaged: Vec<_> = frags.iter().filter(|f| f.damaged.is_some()).collect();
    assert_eq!(damaged.len(), 1, "{frags:#?}");
    assert_eq!((damaged[0].begin, damaged[0].end), (0, first.len() as u64));
    assert!(damaged[0].damaged.as_ref().unwrap().contains("hash to"));
    // Reading into the span from within it is refused the same way.
    let (bytes, done) = read_range(&client, j, 5 << 20, Some(6 << 20))
        .await
        .unwrap();
    assert!(bytes.is_empty());
    assert_eq!((done.status, done.offset), (Status::IO_ERROR, 5 << 20));
    // The rest of the journal reads, and nothing of the span was stored.
    let (bytes, done) = read_range(&client, j, r.begin, Some(r.end)).await.unwrap();
    assert_eq!((bytes, done.status), (second.clone(), Status::OK));
    assert!(
        store.fragments(j).iter().all(|f| f.begin >= r.begin),
        "the damaged span reached the store: {:?}",
        store.fragments(j)
    );
}

/// A fragment file found on disk at start is checked against its name
/// before a read uses it, unless its upload read it whole since: that
/// upload hashed every byte of it, so the first read does not again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_a_fragment_its_upload_read_is_not_checked_again() {
    let store = TestStore::file();
    let mut broker = broker_for(&store, &[]);
    let j = "hist/found-then-uploaded";
    let mut without_store = spec(j, &store, Codec::Zstd, 1 << 30);
    without_store.fragment.stores.clear();
    let bytes = content(41, 300_000);
    {
        // No store yet: the sealed fragment stays on the broker's disk.
        let client = broker.client().await;
        apply(&client, &without_store).await;
        append(&client, j, &bytes).await;
        client
            .seal(j)
            .await
            .unwrap()
            .expect("a non-empty spool seals");
    }
    broker.kill9();
    broker.start_again();
    let client = broker.client().await;
    // With a store, the fragment found at start is uploaded, read whole.
    apply(&client, &spec(j, &store, Codec::Zstd, 1 << 30)).await;
    wait_fragments(&client, j, "the upload", all_uploaded).await;
    let (got, done) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(done.status, Status::OK, "{done:?}");
    assert_eq!(sha1(&got), sha1(&bytes));
    let stats = client.stats().await.unwrap();
    assert_eq!(stats["fragments_checked"], 0, "{stats}");
    assert!(stats["uploads"].as_u64().unwrap() >= 1, "{stats}");
}

/// Pruning lists every store first: one that cannot be listed fails the
/// prune before anything is deleted, so no deletion goes unreported. A
/// pruned span then reads as a gap at once, not as a failing store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_nothing_it_cannot_report() {
    let file = TestStore::file();
    let mut s3 = TestStore::s3("prune-half/");
    let broker = broker_for(&s3, &["--local-cache", "0"]);
    let client = broker.client().await;
    let (on_file, on_s3) = ("half/file", "half/s3");
    for (j, store) in [(on_file, &file), (on_s3, &s3)] {
        let mut s = spec(j, store, Codec::None, 1 << 20);
        s.labels.add("app".into(), "half".into()).unwrap();
        s.fragment.retention = Duration::from_secs(1);
        s.fragment.refresh_interval = Duration::from_secs(600);
        apply(&client, &s).await;
        append(&client, j, b"old bytes").await;
        client.seal(j).await.unwrap();
        wait_store_covers(store, j, 9).await;
    }
    wait_fragments(&client, on_file, "the local copy dropped", |f| {
        local(f).is_empty()
    })
    .await;
    append(&client, on_file, b"new").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    s3.moto().stop();
    let err = client.prune("app=half", false).await.unwrap_err();
    assert_eq!(
        err.status(),
        Some(Status::FRAGMENT_STORE_UNHEALTHY),
        "{err}"
    );
    assert!(err.to_string().contains("nothing was pruned"), "{err}");
    assert_eq!(
        file.fragments(on_file).len(),
        1,
        "a fragment was deleted unreported"
    );
    s3.moto().start_again();
    let s3_held = s3.fragments(on_s3).len();
    let pruned = client.prune("app=half", false).await.unwrap();
    assert_eq!(pruned.len(), 1 + s3_held, "{pruned:?}");
    assert!(pruned.iter().any(|p| p.journal == on_file), "{pruned:?}");
    assert!(file.fragments(on_file).is_empty());
    // The pruned span is a gap at once (the next listing is 10 minutes
    // off), and gone on purpose: the read goes on past it at once, though
    // the fragment after it is younger than `--offset-jump-age`.
    let mut stream = client
        .read_with(
            &ReadRequest {
                journal: on_file.to_string(),
                offset: Some(0),
                end_offset: None,
                route_revision: 0,
            },
            ReadOptions::default(),
        )
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(ev) = stream.next().await {
        match ev.unwrap() {
            ReadEvent::Data { offset, content } => events.push((offset, content.to_vec())),
            ReadEvent::Done(done) => {
                assert_eq!((done.status, done.offset), (Status::OK, 12), "{done:?}");
                break;
            }
            ev => panic!("{ev:?}"),
        }
    }
    assert_eq!(events, [(9, b"new".to_vec())]);
}

/// With no local cache, sealed fragments leave the disk once uploaded; a
/// restart, clean or not, still continues the journal at its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_restart_without_local_cache_keeps_the_head() {
    let store = TestStore::file();
    let mut broker = broker_for(&store, &["--local-cache", "0"]);
    let j = "hist/nocache";
    let mut head = 0;
    for graceful in [false, true, false] {
        let client = broker.client().await;
        if head == 0 {
            apply(&client, &spec(j, &store, Codec::None, 1 << 20)).await;
        }
        let r = append(&client, j, b"hello").await;
        assert_eq!(r.begin, head, "after a restart (graceful: {graceful})");
        head = r.end;
        client.seal(j).await.unwrap();
        wait_store_covers(&store, j, head).await;
        wait_fragments(&client, j, "the local copy dropped", |f| {
            local(f).is_empty()
        })
        .await;
        drop(client);
        if graceful {
            broker.stop_graceful();
            broker.start_again();
        } else {
            broker.restart();
        }
    }
    let client = broker.client().await;
    let r = append(&client, j, b"hello").await;
    assert_eq!((r.begin, r.end), (15, 20));
    assert_eq!(read_proxied(&client, j, 0).await, b"hello".repeat(4));
}

// ---------------------------------------------------------------------------
// A store outage.

/// Spool budget of the outage tests: room for six 5 000-byte fragments
/// awaiting upload.
const OUTAGE_SPOOL_BUDGET: &str = "32K";
const OUTAGE_SPOOL_BUDGET_BYTES: u64 = 32 << 10;
/// Length of each append (and fragment: each is sealed) during the outage.
const OUTAGE_APPEND_LEN: usize = 5000;
/// Appends tried while the store is down; the budget runs out well before.
const OUTAGE_APPENDS_MAX: u32 = 200;

/// A broker whose journal `hist/outage` has uploaded its first fragments;
/// returns the broker, a client, and the bytes appended.
async fn outage_setup(store: &TestStore) -> (Broker, Client, Vec<u8>) {
    let broker = broker_for(store, &["--spool-budget", OUTAGE_SPOOL_BUDGET]);
    let client = broker.client().await;
    let name = "hist/outage";
    apply(&client, &spec(name, store, Codec::Snappy, 4096)).await;
    let mut expected = Vec::new();
    for k in 0..3 {
        let c = content(k, OUTAGE_APPEND_LEN);
        append(&client, name, &c).await;
        expected.extend_from_slice(&c);
    }
    client.seal(name).await.unwrap();
    wait_fragments(&client, name, "uploads", all_uploaded).await;
    (broker, client, expected)
}

/// With the store down, appends and seals `hist/outage` until an append is
/// refused (waiting `pause` after each); returns how many were accepted and
/// the refusal.
async fn append_until_refused(
    client: &Client,
    expected: &mut Vec<u8>,
    pause: Duration,
) -> (u32, rotary_net::client::ClientError) {
    let name = "hist/outage";
    let mut accepted = 0;
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            accepted < OUTAGE_APPENDS_MAX && Instant::now() < deadline,
            "the spool budget never ran out: {accepted} appends accepted"
        );
        let c = content(100 + accepted, OUTAGE_APPEND_LEN);
        match client.append(&req(name), c.clone()).await {
            Ok(r) => {
                assert_eq!(r.begin, expected.len() as u64);
                expected.extend_from_slice(&c);
                accepted += 1;
                client.seal(name).await.unwrap();
                tokio::time::sleep(pause).await;
            }
            Err(e) => return (accepted, e),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_outage_delays_uploads_without_losing_them() {
    let mut store = TestStore::s3("outage/");
    let (_broker, client, mut expected) = outage_setup(&store).await;
    let name = "hist/outage";

    // The store goes away. Appends go on while the spool budget lasts,
    // then are refused with a retryable status.
    store.moto().stop();
    let outage_begin = expected.len() as u64;
    let (accepted, refusal) =
        append_until_refused(&client, &mut expected, Duration::from_millis(100)).await;
    assert!(
        accepted >= 2,
        "only {accepted} appends while the store was down"
    );
    assert_eq!(
        refusal.status(),
        Some(Status::FRAGMENT_STORE_UNHEALTHY),
        "{refusal}"
    );
    assert!(refusal.is_retryable());
    let frags = client.fragments(name).await.unwrap();
    assert!(
        local(&frags).iter().any(|f| f.uploaded == Some(false)),
        "{frags:#?}"
    );
    // Reads go on from local fragments.
    assert!(read_proxied(&client, name, 0).await == expected);

    // The store returns (same endpoint, empty bucket): every fragment gets
    // uploaded and appends are accepted again.
    store.moto().start_again();
    wait_fragments(&client, name, "uploads after the outage", all_uploaded).await;
    let c = content(999, 3000);
    let r = append(&client, name, &c).await;
    assert_eq!(r.begin, expected.len() as u64);
    expected.extend_from_slice(&c);
    client.seal(name).await.unwrap();
    wait_fragments(&client, name, "the last upload", all_uploaded).await;
    let objects = store.fragments(name);
    check_against(&objects, &expected);
    let frags = client.fragments(name).await.unwrap();
    for l in local(&frags).iter().filter(|f| f.begin >= outage_begin) {
        assert!(
            objects
                .iter()
                .any(|o| (o.begin, o.end, o.sha1.as_str()) == (l.begin, l.end, l.sha1.as_str())),
            "{l:?} was not uploaded after the outage"
        );
    }
    assert!(read_proxied(&client, name, 0).await == expected);
    assert!(read_direct(&client, name, 0).await.0 == expected);
}

/// The budget holds however fast appends come: at most one fragment more
/// than `--spool-budget` is sealed while the store is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_spool_budget_holds_while_the_store_is_down() {
    let mut store = TestStore::s3("budget/");
    let (_broker, client, mut expected) = outage_setup(&store).await;
    store.moto().stop();
    let (accepted, refusal) = append_until_refused(&client, &mut expected, Duration::ZERO).await;
    assert_eq!(
        refusal.status(),
        Some(Status::FRAGMENT_STORE_UNHEALTHY),
        "{refusal}"
    );
    let accepted_max = OUTAGE_SPOOL_BUDGET_BYTES / OUTAGE_APPEND_LEN as u64 + 1;
    assert!(
        u64::from(accepted) <= accepted_max,
        "{accepted} appends of {OUTAGE_APPEND_LEN} bytes were sealed while the store was down; \
         the spool budget of {OUTAGE_SPOOL_BUDGET_BYTES} bytes allows {accepted_max}"
    );
}

/// Until its store has been listed once, a journal cannot know whether the
/// store holds offsets beyond its head: appends are refused (retryably)
/// rather than risk reusing offsets, and accepted once the listing works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_unlisted_journal_refuses_appends_until_listed() {
    let mut store = TestStore::s3("unlisted/");
    store.moto().stop();
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    let name = "hist/unlisted";
    apply(&client, &spec(name, &store, Codec::Gzip, 4096)).await;
    // A few refresh intervals: the listing keeps failing.
    for _ in 0..3 {
        let err = client
            .append(&req(name), b"too early".to_vec())
            .await
            .expect_err("the store was never listed");
        assert_eq!(
            err.status(),
            Some(Status::FRAGMENT_STORE_UNHEALTHY),
            "{err}"
        );
        assert!(err.is_retryable());
        // A read does not take the unlisted journal for an empty one.
        let (bytes, done) = read_range(&client, name, 0, None).await.unwrap();
        assert!(bytes.is_empty());
        assert_eq!(done.status, Status::FRAGMENT_STORE_UNHEALTHY, "{done:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    store.moto().start_again();
    let r = append(&client, name, b"listed").await;
    assert_eq!((r.begin, r.end), (0, 6));
    client.seal(name).await.unwrap();
    wait_fragments(&client, name, "upload", all_uploaded).await;
    let objects = store.fragments(name);
    check_against(&objects, b"listed");
    assert_eq!(objects.len(), 1);
}

/// A broker with no S3 credentials in its environment, off a cloud
/// instance, is told so: the refusal names the missing credentials rather
/// than only the metadata service it asked for them (here a closed port).
/// Every journal's listing fails, and the log says so once per shard, not
/// once per journal. Given credentials, the same journal on the same store
/// takes appends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_without_credentials_says_so_once() {
    const JOURNALS: usize = 12;
    const FAILED: &str = "listing the fragment store failed";
    let store = TestStore::s3("nocreds/");
    let metadata = format!("http://127.0.0.1:{}", free_port_range(1));
    let bare = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            env: vec![
                ("AWS_METADATA_ENDPOINT".into(), metadata.clone()),
                ("AWS_REGION".into(), "us-east-1".into()),
            ],
            env_remove: std::env::vars()
                .map(|(k, _)| k)
                .filter(|k| k.starts_with("AWS_"))
                .collect(),
            ..Default::default()
        },
    );
    let client = bare.client().await;
    let names: Vec<String> = (0..JOURNALS).map(|i| format!("hist/nocreds-{i}")).collect();
    let specs: Vec<JournalSpec> = names
        .iter()
        .map(|n| spec(n, &store, Codec::None, 4096))
        .collect();
    assert_eq!(client.apply(&specs).await.unwrap(), JOURNALS as u64);
    // Until a journal's first listing has failed, its refusal cannot say
    // why yet.
    let deadline = Instant::now() + WAIT;
    for name in &names {
        loop {
            let err = client
                .append(&req(name), b"no credentials".to_vec())
                .await
                .expect_err("the store cannot be listed without credentials");
            assert_eq!(
                err.status(),
                Some(Status::FRAGMENT_STORE_UNHEALTHY),
                "{err}"
            );
            let said = err.to_string();
            if said.contains("no credentials") {
                assert!(
                    said.contains("AWS_ACCESS_KEY_ID") && said.contains(&metadata),
                    "{said}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "{said}");
            tokio::time::sleep(POLL).await;
        }
    }
    let log = bare.log();
    let logged = log.lines().filter(|l| l.contains(FAILED)).count();
    assert!(
        (1..=CORES_DEFAULT).contains(&logged),
        "{JOURNALS} journals on one store, {CORES_DEFAULT} shards: logged {logged} times:\n{log}"
    );
    drop(client);
    drop(bare);

    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    apply(&client, &specs[0]).await;
    let r = append(&client, &names[0], b"credentials").await;
    assert_eq!((r.begin, r.end), (0, 11));
}

/// After a start, a shard lists every journal's stores, at most 32 at once
/// and the rest in a queue. An append to a journal whose first listing is
/// still queued starts that listing at once instead of waiting its turn:
/// here every slot is taken by listings of a store that hangs, and appends
/// to journals on a store that works are answered all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_starts_its_journals_first_listing_ahead_of_the_queue() {
    const HANGING: usize = 400;
    const WORKING: usize = 8;
    let mut s3 = TestStore::s3("hurry/");
    let file = TestStore::file();
    let mut broker = Broker::start_with(
        1,
        BrokerOpts {
            args: Vec::new(),
            env: s3.broker_env(),
            ..Default::default()
        },
    );
    let client = broker.client().await;
    let hanging: Vec<String> = (0..HANGING).map(|i| format!("hurry/s3-{i:03}")).collect();
    let working: Vec<String> = (0..WORKING).map(|i| format!("hurry/file-{i}")).collect();
    let mut specs: Vec<JournalSpec> = hanging
        .iter()
        .map(|n| spec(n, &s3, Codec::None, 1 << 20))
        .collect();
    specs.extend(working.iter().map(|n| spec(n, &file, Codec::None, 1 << 20)));
    client.apply(&specs).await.unwrap();
    // Each holds bytes on the local disk, so each is opened, and listed,
    // when the broker starts.
    let mut appends = tokio::task::JoinSet::new();
    for n in hanging.iter().chain(&working) {
        let (client, n) = (client.clone(), n.clone());
        appends.spawn(async move { append(&client, &n, b"before").await });
    }
    while let Some(done) = appends.join_next().await {
        assert_eq!(done.unwrap().begin, 0);
    }
    drop(client);
    broker.kill9();
    s3.moto().pause();
    broker.start_again();
    let client = broker.client().await;
    let answered = tokio::time::timeout(WAIT, async {
        for n in &working {
            let r = append(&client, n, b"after").await;
            assert_eq!((r.begin, r.end), (6, 11), "{n}");
        }
    })
    .await;
    let hurried = client.stats().await.unwrap()["listings_hurried"]
        .as_u64()
        .expect("listings_hurried in STATS");
    s3.moto().resume();
    assert!(
        answered.is_ok(),
        "appends to journals on a working store waited for {HANGING} listings of a hanging one"
    );
    // With 400 journals ahead of them, all eight cannot have been among
    // the first 32 listings started.
    assert!(hurried >= 1, "{hurried} listings hurried");
    for n in &working {
        let (bytes, _) = read_range(&client, n, 0, None).await.unwrap();
        assert_eq!(bytes, b"beforeafter", "{n}");
    }
}

// Long histories.

/// A journal whose store holds more fragments than one FRAGMENTS reply
/// lists is answered in pages: each at most the limit asked for (1000 by
/// default), flagged while fragments remain, never splitting the copies of
/// one span; the client and the CLI walk every page. Bad page requests
/// are `BAD_REQUEST`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_of_a_long_history_come_in_pages() {
    use rotary_net::wire::{self, flag, Op};
    const STORED: u64 = 2345;
    const SPAN: u64 = 100;
    let store = TestStore::file();
    let j = "hist/long";
    // History written by an earlier broker: objects named as fragments
    // (their bytes are not read here).
    let TestStore::File { dir } = &store else {
        unreachable!()
    };
    let objects = dir.path().join(j);
    std::fs::create_dir_all(&objects).unwrap();
    for i in 0..STORED {
        let name = format!("{:016x}-{:016x}-{:040x}.zst", i * SPAN, (i + 1) * SPAN, i);
        std::fs::write(objects.join(name), b"").unwrap();
    }
    let broker = broker_for(&store, &[]);
    let client = broker.client().await;
    apply(&client, &spec(j, &store, Codec::Zstd, 1 << 20)).await;

    let all = wait_fragments(&client, j, "the store's listing", |f| !f.is_empty()).await;
    let begins: Vec<u64> = all.iter().map(|f| f.begin).collect();
    assert_eq!(begins, (0..STORED).map(|i| i * SPAN).collect::<Vec<_>>());
    assert!(all
        .iter()
        .all(|f| f.store == store.url() && f.end == f.begin + SPAN));

    // Pages of 1000, 1000 and 345, each following on from the last.
    let mut from = 0;
    let mut sizes = Vec::new();
    let mut paged = Vec::new();
    loop {
        let page = client.fragments_page(j, from, 1000).await.unwrap();
        sizes.push(page.fragments.len());
        paged.extend(page.fragments);
        match page.next {
            Some(next) => from = next,
            None => break,
        }
    }
    assert_eq!(sizes, [1000, 1000, 345]);
    assert_eq!(paged, all);
    // From the middle of a span: fragments beginning at or after it.
    let page = client.fragments_page(j, 5 * SPAN + 1, 3).await.unwrap();
    let got: Vec<u64> = page.fragments.iter().map(|f| f.begin).collect();
    assert_eq!(got, [6 * SPAN, 7 * SPAN, 8 * SPAN]);
    assert_eq!(page.next, Some(8 * SPAN + 1));
    let page = client.fragments_page(j, STORED * SPAN, 10).await.unwrap();
    assert_eq!((page.fragments.len(), page.next), (0, None));

    // On the wire: an empty payload is the default page, flagged.
    let owner = rotary_net::shard_of(j, CORES_DEFAULT as u32);
    let mut s = raw_connect(&broker.shard_endpoint(owner as usize));
    let ask = |s: &mut std::net::TcpStream, id: u64, payload: &[u8]| {
        use std::io::Write;
        s.write_all(&frame(Op::FRAGMENTS, 0, id, &wire::encode_name(j), payload))
            .unwrap();
        let r = read_raw_frame(s).unwrap().expect("a reply");
        assert_eq!((r.op, r.request_id), (Op::ADMIN_REPLY, id));
        r
    };
    let r = ask(&mut s, 1, b"");
    assert_eq!((r.status, r.flags), (Status::OK as u16, flag::NEXT_PAGE));
    let listed: Vec<FragmentInfo> = serde_json::from_slice(&r.payload).unwrap();
    assert_eq!(listed, all[..wire::FRAGMENTS_PAGE_MAX as usize]);
    let r = ask(&mut s, 2, br#"{"from": 234000}"#);
    assert_eq!((r.status, r.flags), (Status::OK as u16, 0));
    let listed: Vec<FragmentInfo> = serde_json::from_slice(&r.payload).unwrap();
    assert_eq!(listed, all[2340..]);
    for (id, bad) in [
        (3, &br#"{"limit": 0}"#[..]),
        (4, br#"{"limit": 1001}"#),
        (5, br#"{"from": 0, "page": 2}"#),
        (6, b"not json"),
        (7, br#"{"from": -1}"#),
    ] {
        let r = ask(&mut s, id, bad);
        assert_eq!(
            r.status,
            Status::BAD_REQUEST as u16,
            "{}: {}",
            String::from_utf8_lossy(bad),
            String::from_utf8_lossy(&r.payload)
        );
    }

    // The CLI lists every page.
    let (code, out, err) = run_cli(broker.cli(&["fragments", j, "-o", "json"]), b"");
    assert_eq!(code, 0, "{err}");
    let listed: Vec<FragmentInfo> = serde_json::from_slice(&out).unwrap();
    assert_eq!(listed, all);

    // A local fragment and its store copy begin at the same offset: a
    // page of one holds both.
    let k = "hist/copies";
    apply(&client, &spec(k, &store, Codec::None, 1 << 20)).await;
    for part in [&b"first"[..], b"second", b"third"] {
        append(&client, k, part).await;
        client.seal(k).await.unwrap();
    }
    let all = wait_fragments(&client, k, "every upload listed", |f| {
        all_uploaded(f) && stored(f).len() == 3
    })
    .await;
    assert_eq!(all.len(), 6);
    let mut from = 0;
    let mut paged = Vec::new();
    loop {
        let page = client.fragments_page(k, from, 1).await.unwrap();
        assert_eq!(page.fragments.len(), 2, "{:#?}", page.fragments);
        assert_eq!(page.fragments[0].begin, page.fragments[1].begin);
        assert_eq!(
            (
                &*page.fragments[0].store,
                page.fragments[1].store == store.url()
            ),
            ("local", true)
        );
        paged.extend(page.fragments);
        match page.next {
            Some(next) => from = next,
            None => break,
        }
    }
    assert_eq!(paged, all);
}

/// A broker that lost its disk refuses plain appends below its store's
/// history, and (as in Gazette) an append naming exactly the history's end
/// as its offset moves the head there and commits; any other offset is the
/// wrong one. The moved head outlives a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_an_explicit_offset_at_the_history_end_moves_the_head() {
    let store = TestStore::file();
    let name = "hist/explicit";
    let spec = spec(name, &store, Codec::None, 8 << 10);
    let mut broker = broker_for(&store, &[]);
    let mut expected = Vec::new();
    {
        let client = broker.client().await;
        apply(&client, &spec).await;
        for k in 0..12u32 {
            let c = content(k, 900 + 77 * k as usize);
            append(&client, name, &c).await;
            expected.extend_from_slice(&c);
        }
    }
    broker.stop_graceful();
    let head = expected.len() as u64;
    check_against(&wait_store_covers(&store, name, head).await, &expected);
    broker.wipe_data();
    broker.start_again();
    let client = broker.client().await;
    apply(&client, &spec).await;

    let at = |offset: Option<u64>| AppendRequest {
        expect_offset: offset,
        ..req(name)
    };
    let deadline = Instant::now() + WAIT;
    let plain = loop {
        match client.append(&at(None), b"plain".to_vec()).await {
            Ok(r) => panic!("a plain append below the history committed at {r:?}"),
            Err(e) if e.status() == Some(Status::FRAGMENT_STORE_UNHEALTHY) => {
                assert!(Instant::now() < deadline, "store never listed: {e}");
                tokio::time::sleep(POLL).await;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        plain.status(),
        Some(Status::INDEX_HAS_GREATER_OFFSET),
        "{plain}"
    );
    assert!(
        plain
            .to_string()
            .contains(&format!("append with offset {head}")),
        "{plain}"
    );
    for wrong in [0, head - 1, head + 1] {
        let e = client
            .append(&at(Some(wrong)), b"wrong".to_vec())
            .await
            .unwrap_err();
        assert_eq!(
            e.status(),
            Some(Status::WRONG_APPEND_OFFSET),
            "{wrong}: {e}"
        );
    }
    let r = client
        .append(&at(Some(head)), b"at the end".to_vec())
        .await
        .unwrap();
    assert_eq!((r.begin, r.end), (head, head + 10));
    expected.extend_from_slice(b"at the end");
    let r = append(&client, name, b"+plain").await;
    assert_eq!(r.begin, head + 10);
    expected.extend_from_slice(b"+plain");

    drop(client);
    tokio::task::block_in_place(|| broker.restart());
    let client = broker.client().await;
    let r = append(&client, name, b"+after").await;
    assert_eq!(r.begin, head + 16, "the moved head outlived the restart");
    expected.extend_from_slice(b"+after");
    assert!(read_proxied(&client, name, 0).await == expected);
    client.seal(name).await.unwrap();
    drop(client);
    broker.stop_graceful();
    check_against(
        &wait_store_covers(&store, name, expected.len() as u64).await,
        &expected,
    );
}
