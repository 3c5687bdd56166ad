//! End-to-end: append/read round trips through the client library and the
//! CLI, blocking tails, journal admin through the CLI, fsync journals.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_net::client::{ReadEvent, APPEND_CHUNK_LEN};
use rotary_net::spec::{parse_specs, Durability, LabelSet};
use rotary_net::wire::{AppendRequest, ReadRequest};
use rotary_net::{shard_of, Status};
use std::time::Duration;

fn append_req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_append_read_round_trip() {
    let broker = Broker::start();
    let client = broker.client().await;
    client.ping().await.unwrap();
    let j = "e2e/basic/round-trip";
    create_journal(&client, j, |_| {}).await;

    // A small append goes in one frame.
    let small = b"hello, journal".to_vec();
    let r1 = client.append(&append_req(j), small.clone()).await.unwrap();
    assert_eq!(
        (r1.begin, r1.end, r1.write_head),
        (0, small.len() as u64, small.len() as u64)
    );
    assert_eq!(r1.sha1, sha1(&small));

    // A large append is chunked (APPEND + APPEND_CHUNKs) and commits whole.
    let big = pattern(3 * APPEND_CHUNK_LEN + 12_345, 7);
    let r2 = client.append(&append_req(j), big.clone()).await.unwrap();
    assert_eq!(r2.begin, r1.end);
    assert_eq!(r2.end, r1.end + big.len() as u64);
    assert_eq!(r2.sha1, sha1(&big));

    // A streamed append from an AsyncRead.
    let streamed = pattern(2 * APPEND_CHUNK_LEN + 99, 3);
    let r3 = client
        .append_stream(&append_req(j), &streamed[..])
        .await
        .unwrap();
    assert_eq!((r3.begin, r3.end), (r2.end, r2.end + streamed.len() as u64));
    assert_eq!(r3.sha1, sha1(&streamed));

    // An empty append learns the head without changing anything.
    let r4 = client.append(&append_req(j), Vec::new()).await.unwrap();
    assert_eq!((r4.begin, r4.end, r4.write_head), (r3.end, r3.end, r3.end));

    let mut all = small.clone();
    all.extend_from_slice(&big);
    all.extend_from_slice(&streamed);
    let head = all.len() as u64;
    assert_eq!(read_all(&client, j).await, all);

    // A sub-range, crossing append boundaries.
    let (part, done) = read_range(&client, j, 5, Some(r2.begin + 100))
        .await
        .unwrap();
    assert_eq!(part, all[5..(r2.begin + 100) as usize]);
    assert_eq!(
        (done.status, done.offset, done.write_head),
        (Status::OK, r2.begin + 100, head)
    );

    // Metadata only.
    let req = ReadRequest {
        journal: j.into(),
        offset: Some(7),
        end_offset: None,
        route_revision: 0,
    };
    let mut s = client.read(&req, false, true).await.unwrap();
    match s.next().await.unwrap().unwrap() {
        ReadEvent::Done(d) => assert_eq!((d.status, d.offset, d.write_head), (Status::OK, 7, head)),
        other => panic!("metadata read sent {other:?}"),
    }
    assert!(s.next().await.is_none());
    assert_eq!(write_head(&client, j).await, head);

    // At the head, a non-blocking read has nothing yet.
    let (bytes, done) = read_range(&client, j, head, None).await.unwrap();
    assert!(bytes.is_empty());
    assert_eq!(
        (done.status, done.write_head),
        (Status::OFFSET_NOT_YET_AVAILABLE, head)
    );

    // Fragments cover [0, head) contiguously and their SHA-1s are right.
    let frags = client.fragments(j).await.unwrap();
    assert!(!frags.is_empty());
    assert_eq!(frags[0].begin, 0);
    assert_eq!(frags.last().unwrap().end, head);
    for w in frags.windows(2) {
        assert_eq!(w[0].end, w[1].begin, "{frags:?}");
    }
    for f in &frags {
        assert_eq!(
            f.sha1,
            hex_sha1(&all[f.begin as usize..f.end as usize]),
            "{f:?}"
        );
    }

    // Sealing closes the spool; the next append continues at the head.
    let sealed = client
        .seal(j)
        .await
        .unwrap()
        .expect("a non-empty spool seals");
    assert_eq!(sealed.end, head);
    assert!(!sealed.open);
    let frags = client.fragments(j).await.unwrap();
    assert!(frags.iter().all(|f| !f.open), "{frags:?}");
    let r5 = client
        .append(&append_req(j), b"after seal".to_vec())
        .await
        .unwrap();
    assert_eq!(r5.begin, head);
    all.extend_from_slice(b"after seal");
    assert_eq!(read_all(&client, j).await, all);

    let stats = client.stats().await.unwrap();
    for key in [
        "cross_core_forwards",
        "appends",
        "append_bytes",
        "reads",
        "shards",
    ] {
        assert!(stats.get(key).is_some(), "stats lack {key}: {stats}");
    }
    assert_eq!(stats["shards"], serde_json::json!(broker.cores));
    // This client routes every request to the owning shard.
    assert_eq!(
        stats["cross_core_forwards"],
        serde_json::json!(0),
        "{stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_append_read_round_trip() {
    let broker = Broker::start();
    let j = "e2e/cli/round-trip";
    let spec = format!("{{\"name\": \"{j}\", \"fragment\": {{\"length\": 67108864, \"compression_codec\": \"none\"}}}}");
    let (code, out, err) = run_cli(
        broker.cli(&["journals", "apply", "-f", "-"]),
        spec.as_bytes(),
    );
    assert_eq!(code, 0, "{err}");
    assert!(String::from_utf8_lossy(&out).contains(j));

    // From standard input, streamed.
    let first = pattern(300_000, 1);
    let (code, out, err) = run_cli(broker.cli(&["append", j]), &first);
    assert_eq!(code, 0, "{err}");
    let line: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        out.iter().filter(|&&b| b == b'\n').count(),
        1,
        "one JSON line"
    );
    assert_eq!(line["journal"], j);
    assert_eq!(line["begin"], 0);
    assert_eq!(line["end"], first.len() as u64);
    assert_eq!(line["sha1"], hex_sha1(&first));
    assert_eq!(line["registers"], serde_json::json!({}));

    // From a file, with an expected offset and a register change.
    let second = pattern(5_000, 2);
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "second.bin", &second);
    let off = first.len().to_string();
    let (code, out, err) = run_cli(
        broker.cli(&[
            "append",
            j,
            "-i",
            path.to_str().unwrap(),
            "--offset",
            &off,
            "--union-registers",
            "owner=cli",
        ]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let line: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(line["begin"], first.len() as u64);
    assert_eq!(line["end"], (first.len() + second.len()) as u64);
    assert_eq!(line["sha1"], hex_sha1(&second));
    assert_eq!(line["registers"], serde_json::json!({"owner": "cli"}));
    let head = (first.len() + second.len()) as u64;

    // Read everything, a range, and at the head.
    let mut all = first.clone();
    all.extend_from_slice(&second);
    let (code, out, err) = run_cli(broker.cli(&["read", j]), b"");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, all);
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "10", "--end-offset", "302000"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, all[10..302_000]);
    let (code, out, err) = run_cli(broker.cli(&["read", j, "--offset", &head.to_string()]), b"");
    assert_eq!((code, out.len(), err.as_str()), (0, 0, ""));
    // Past the head there is nothing yet either, and the CLI says so.
    let past = (head + 100).to_string();
    let (code, out, err) = run_cli(broker.cli(&["read", j, "--offset", &past]), b"");
    assert_eq!((code, out.len()), (0, 0), "{err}");
    assert!(
        err.contains(&format!("offset {past} is beyond the write head {head}")),
        "{err}"
    );
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "head", "--metadata"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let meta: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        meta,
        serde_json::json!({"offset": head, "write_head": head})
    );

    // The client library sees the same bytes.
    let client = broker.client().await;
    assert_eq!(read_all(&client, j).await, all);

    // Fragments and stats print JSON.
    let (code, out, err) = run_cli(broker.cli(&["fragments", j, "-o", "json"]), b"");
    assert_eq!(code, 0, "{err}");
    let frags: Vec<serde_json::Value> = serde_json::from_slice(&out).unwrap();
    assert_eq!(frags.last().unwrap()["end"], head);
    let (code, out, err) = run_cli(broker.cli(&["fragments", j]), b"");
    assert_eq!(code, 0, "{err}");
    assert!(String::from_utf8_lossy(&out).starts_with("BEGIN"));
    let (code, out, err) = run_cli(broker.cli(&["stats"]), b"");
    assert_eq!(code, 0, "{err}");
    let stats: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert!(stats["appends"].as_u64().unwrap() >= 2, "{stats}");

    // ROTARY_BROKER names the broker when --broker is absent.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"));
    cmd.args(["read", j, "--offset", "0", "--end-offset", "4"])
        .env("ROTARY_BROKER", broker.endpoint());
    let (code, out, err) = run_cli(cmd, b"");
    assert_eq!((code, out), (0, all[..4].to_vec()), "{err}");

    // Errors: one line naming the status, exit 1 (2 for invalid input, 3
    // when retryable).
    let (code, out, err) = run_cli(broker.cli(&["append", "e2e/cli/missing"]), b"x");
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert!(err.starts_with("error: JOURNAL_NOT_FOUND: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let (code, _, err) = run_cli(broker.cli(&["append", j, "--offset", "1"]), b"x");
    assert_eq!(code, 1);
    assert!(err.starts_with("error: WRONG_APPEND_OFFSET: "), "{err}");
    let (code, _, err) = run_cli(
        broker.cli(&["append", j, "--check-registers", "owner=other"]),
        b"x",
    );
    assert_eq!(code, 1);
    assert!(err.starts_with("error: REGISTER_MISMATCH: "), "{err}");
    let (code, _, err) = run_cli(broker.cli(&["read", "e2e/cli/missing"]), b"");
    assert_eq!(code, 1);
    assert!(err.starts_with("error: JOURNAL_NOT_FOUND: "), "{err}");
    // A blocking read at the head is not an error, it waits: bound it.
    let (code, out, err) = run_cli(
        broker.cli(&[
            "read",
            j,
            "--offset",
            &(head - 3).to_string(),
            "--end-offset",
            &head.to_string(),
            "--block",
        ]),
        b"",
    );
    assert_eq!((code, out), (0, all[all.len() - 3..].to_vec()), "{err}");
    // Nothing failed appends did is visible.
    assert_eq!(read_all(&client, j).await, all);

    // The broker unreachable: retryable, exit 3.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"));
    let dead = format!("127.0.0.1:{}", free_port_range(1));
    cmd.args(["stats", "--broker", &dead]);
    let (code, _, err) = run_cli(cmd, b"");
    assert_eq!(code, 3, "{err}");
    assert!(err.starts_with("error: UNAVAILABLE: "), "{err}");
}

/// Each journal that readers tail keeps its newest bytes in memory, and a
/// shard's journals share a bounded amount of it: 120 journals, each with
/// a reader waiting at its head, each take 2 MiB; every reader gets its
/// journal's bytes, and the broker's tail caches hold no more than 64 MiB
/// per shard (before the bound, each held all 2 MiB and more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tailed_journals_share_a_bounded_tail_cache() {
    const JOURNALS: usize = 120;
    const BYTES: usize = 2 << 20;
    let broker = Broker::start();
    let client = broker.client().await;
    let names: Vec<String> = (0..JOURNALS)
        .map(|i| format!("e2e/tailed/j-{i:03}"))
        .collect();
    for n in &names {
        create_journal(&client, n, |_| {}).await;
    }
    let readers = broker.client().await;
    let mut streams = Vec::new();
    for n in &names {
        let req = ReadRequest {
            journal: n.clone(),
            offset: Some(0),
            end_offset: Some(BYTES as u64),
            route_revision: 0,
        };
        streams.push(readers.read(&req, true, false).await.unwrap());
    }
    // Let the reads reach the broker and wait at the head.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let content = |i: usize| -> Vec<u8> {
        (0..BYTES)
            .map(|k| (k as u8).wrapping_mul(7) ^ (k >> 12) as u8 ^ i as u8)
            .collect()
    };
    for (i, n) in names.iter().enumerate() {
        let r = client.append(&append_req(n), content(i)).await.unwrap();
        assert_eq!((r.begin, r.end), (0, BYTES as u64), "{n}");
    }
    for (i, stream) in streams.into_iter().enumerate() {
        let (got, done) =
            tokio::time::timeout(Duration::from_secs(30), read_to_done(stream, &names[i], 0))
                .await
                .expect("tail served within 30 s")
                .unwrap();
        assert_eq!((done.status, done.offset), (Status::OK, BYTES as u64));
        assert!(got == content(i), "{} read back different bytes", names[i]);
    }
    let stats = client.stats().await.unwrap();
    let held = stats["tail_cache_bytes"]
        .as_u64()
        .expect("tail_cache_bytes");
    let shards = stats["shards"].as_u64().unwrap();
    assert!(held > 0, "{stats}");
    assert!(held <= shards * (64 << 20), "{held} bytes held: {stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_tail_is_woken_by_a_later_append() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/tail/woken";
    create_journal(&client, j, |_| {}).await;
    let prefix = client
        .append(&append_req(j), b"prefix".to_vec())
        .await
        .unwrap();
    let head = prefix.end;
    let tail = b"tail bytes arrive".to_vec();

    // Three readers wait at the head before the append: one bounded by an
    // end offset, one cancelled explicitly, one dropped.
    let at_head = |end: Option<u64>| ReadRequest {
        journal: j.into(),
        offset: Some(head),
        end_offset: end,
        route_revision: 0,
    };
    let mut bounded = client
        .read(&at_head(Some(head + tail.len() as u64)), true, false)
        .await
        .unwrap();
    let mut open = client.read(&at_head(None), true, false).await.unwrap();
    let dropped = client.read(&at_head(None), true, false).await.unwrap();
    // Nothing arrives while nothing is appended.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), open.next())
            .await
            .is_err()
    );

    // The append comes from another connection.
    let other = broker.client().await;
    let r = other.append(&append_req(j), tail.clone()).await.unwrap();
    assert_eq!(r.begin, head);

    for stream in [&mut bounded, &mut open] {
        let mut got = Vec::new();
        while got.len() < tail.len() {
            let ev = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .expect("tail woken within 10 s")
                .expect("event")
                .unwrap();
            match ev {
                ReadEvent::Data { offset, content } => {
                    assert_eq!(offset, head + got.len() as u64);
                    got.extend_from_slice(&content);
                }
                ReadEvent::Done(d) => panic!("read ended early: {d:?}"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, tail);
    }
    // The bounded read ends OK at its end offset.
    match bounded.next().await.unwrap().unwrap() {
        ReadEvent::Done(d) => {
            assert_eq!((d.status, d.offset), (Status::OK, head + tail.len() as u64))
        }
        other => panic!("{other:?}"),
    }
    // The open one ends CANCELLED when cancelled.
    let done = open.cancel().await.unwrap();
    assert_eq!(
        (done.status, done.offset),
        (Status::CANCELLED, head + tail.len() as u64)
    );
    drop(dropped);

    // The connection still serves, and a new tail sees the next append.
    client.ping().await.unwrap();
    let mut next = client
        .read(&at_head(Some(r.end + 3)), true, false)
        .await
        .unwrap();
    client
        .append(&append_req(j), b"end".to_vec())
        .await
        .unwrap();
    let mut got = Vec::new();
    loop {
        match next.next().await.unwrap().unwrap() {
            ReadEvent::Data { offset, content } => {
                assert!(offset >= head);
                got.extend_from_slice(&content);
            }
            ReadEvent::Done(d) => {
                assert_eq!(d.status, Status::OK);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let mut want = tail.clone();
    want.extend_from_slice(b"end");
    assert_eq!(got, want);
}

/// The one READ_DONE of a metadata-only read: status, offset, write head.
async fn only_done(s: &mut rotary_net::client::ReadStream) -> (Status, u64, u64) {
    match s.next().await {
        Some(Ok(ReadEvent::Done(d))) => (d.status, d.offset, d.write_head),
        other => panic!("a metadata read answers READ_DONE only: {other:?}"),
    }
}

/// A metadata-only read below the head answers at once; at the head it
/// answers OFFSET_NOT_YET_AVAILABLE with the head, or, blocking, waits for
/// the next commit and then answers once (as Gazette's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_metadata_read_at_the_head_answers_at_the_next_commit() {
    use rotary_net::client::ReadOptions;
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/meta/block";
    create_journal(&client, j, |_| {}).await;
    client
        .append(&append_req(j), b"abc".to_vec())
        .await
        .unwrap();
    let at = |offset: Option<u64>| ReadRequest {
        journal: j.into(),
        offset,
        end_offset: None,
        route_revision: 0,
    };
    let meta = |block: bool| ReadOptions {
        block,
        metadata_only: true,
        do_not_proxy: false,
    };
    let mut s = client.read_with(&at(Some(1)), meta(false)).await.unwrap();
    assert_eq!(only_done(&mut s).await, (Status::OK, 1, 3));
    let mut s = client.read_with(&at(Some(1)), meta(true)).await.unwrap();
    assert_eq!(only_done(&mut s).await, (Status::OK, 1, 3));
    let mut s = client.read_with(&at(None), meta(false)).await.unwrap();
    assert_eq!(
        only_done(&mut s).await,
        (Status::OFFSET_NOT_YET_AVAILABLE, 3, 3)
    );

    let mut waiting = client.read_with(&at(None), meta(true)).await.unwrap();
    let mut past = client.read_with(&at(Some(4)), meta(true)).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting.next())
            .await
            .is_err(),
        "nothing answers before a commit"
    );
    client.append(&append_req(j), b"d".to_vec()).await.unwrap();
    assert_eq!(only_done(&mut waiting).await, (Status::OK, 3, 4));
    assert!(waiting.next().await.is_none(), "answered once");
    client.append(&append_req(j), b"e".to_vec()).await.unwrap();
    assert_eq!(only_done(&mut past).await, (Status::OK, 4, 5));

    // The CLI prints the head for a read "at the head" either way.
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "head", "--metadata"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v, serde_json::json!({"offset": 5, "write_head": 5}));
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "2", "--metadata", "--block"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v, serde_json::json!({"offset": 2, "write_head": 5}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journals_apply_list_delete_through_the_cli() {
    let broker = Broker::start();
    let yaml = r#"
- name: cli/orders/part-000
  labels: {app: orders, region: eu}
  fragment: {length: 67108864, compression_codec: none}
- name: cli/orders/part-001
  labels: {app: orders, region: us}
  durability: fsync
- name: cli/logs/part-000
  labels: {app: logs}
  flags: read-only
"#;
    let specs = parse_specs(yaml).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(dir.path(), "journals.yaml", yaml.as_bytes());
    let (code, out, err) = run_cli(
        broker.cli(&["journals", "apply", "-f", file.to_str().unwrap()]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        String::from_utf8_lossy(&out).contains("applied 3"),
        "{}",
        String::from_utf8_lossy(&out)
    );

    let list_yaml = |selector: &str| {
        let (code, out, err) = run_cli(
            broker.cli(&["journals", "list", "-l", selector, "-o", "yaml"]),
            b"",
        );
        assert_eq!(code, 0, "{err}");
        let text = String::from_utf8(out).unwrap();
        if text.trim() == "[]" {
            Vec::new()
        } else {
            // Each spec comes with the revision it was read at (what
            // `apply` checks when it is given back); the rest is a spec.
            let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
            for v in doc.as_sequence_mut().expect("a list") {
                let r = v.as_mapping_mut().and_then(|m| m.remove("revision"));
                assert!(r.and_then(|r| r.as_u64()).is_some_and(|r| r > 0), "{text}");
            }
            parse_specs(&serde_yaml::to_string(&doc).unwrap())
                .unwrap_or_else(|e| panic!("list -o yaml is not apply input: {e}\n{text}"))
        }
    };
    // YAML out is the shape apply takes, sorted by name.
    let all = list_yaml("");
    let mut sorted = specs.clone();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(all, sorted);
    let orders = list_yaml("app=orders");
    assert_eq!(orders, vec![specs[0].clone(), specs[1].clone()]);
    assert_eq!(list_yaml("app=orders,region!=eu"), vec![specs[1].clone()]);
    assert_eq!(list_yaml("!region"), vec![specs[2].clone()]);
    assert_eq!(list_yaml("app=nothing"), vec![]);
    // Gazette's set forms.
    assert_eq!(list_yaml("region in (us, asia)"), vec![specs[1].clone()]);
    assert_eq!(
        list_yaml("app in (orders,logs),region notin (us)"),
        vec![specs[2].clone(), specs[0].clone()]
    );

    // JSON has routes; the table shows every journal.
    let (code, out, err) = run_cli(broker.cli(&["journals", "list", "-o", "json"]), b"");
    assert_eq!(code, 0, "{err}");
    let entries: Vec<serde_json::Value> = serde_json::from_slice(&out).unwrap();
    assert_eq!(entries.len(), 3);
    for e in &entries {
        let name = e["spec"]["name"].as_str().unwrap();
        let shard = shard_of(name, broker.cores as u32);
        assert_eq!(e["route"]["shard"], shard, "{e}");
        assert_eq!(
            e["route"]["endpoint"],
            broker.shard_endpoint(shard as usize),
            "{e}"
        );
    }
    let (code, out, err) = run_cli(broker.cli(&["journals", "list"]), b"");
    assert_eq!(code, 0, "{err}");
    let table = String::from_utf8(out).unwrap();
    assert!(table.starts_with("NAME"), "{table}");
    for s in &specs {
        assert!(table.contains(&s.name), "{table}");
    }
    assert!(table.contains("fsync"), "{table}");

    // Round trip: apply what list printed, with a label changed (replace).
    let mut changed = orders.clone();
    changed[0].labels = LabelSet::from_pairs([("app", "orders"), ("region", "apac")]).unwrap();
    let text = serde_yaml::to_string(&changed).unwrap();
    let (code, _, err) = run_cli(
        broker.cli(&["journals", "apply", "-f", "-"]),
        text.as_bytes(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(list_yaml("region=apac"), vec![changed[0].clone()]);
    assert_eq!(list_yaml("region=eu"), vec![]);

    // Seal and delete.
    let client = broker.client().await;
    client
        .append(&append_req("cli/orders/part-000"), b"some bytes".to_vec())
        .await
        .unwrap();
    let (code, out, err) = run_cli(
        broker.cli(&["journals", "seal", "cli/orders/part-000"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let sealed: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(sealed["sealed"]["end"], 10, "{sealed}");
    assert_eq!(
        sealed["sealed"]["sha1"],
        hex_sha1(b"some bytes"),
        "{sealed}"
    );
    let (code, _, err) = run_cli(
        broker.cli(&["journals", "delete", "cli/orders/part-001"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(list_yaml("app=orders"), vec![changed[0].clone()]);
    let (code, _, err) = run_cli(
        broker.cli(&["journals", "delete", "cli/orders/part-001"]),
        b"",
    );
    assert_eq!(code, 1);
    assert!(err.starts_with("error: JOURNAL_NOT_FOUND: "), "{err}");
    assert_eq!(
        status_of(
            client
                .append(&append_req("cli/orders/part-001"), b"x".to_vec())
                .await
        ),
        Status::JOURNAL_NOT_FOUND
    );

    // Bad input is bad usage: exit 2, nothing applied.
    let (code, _, err) = run_cli(broker.cli(&["journals", "apply", "-f", "-"]), b"name: ab\n");
    assert_eq!(code, 2);
    assert!(err.starts_with("error: BAD_REQUEST: "), "{err}");
    let long_part = format!("name: cli/{}\n", "b".repeat(256));
    let (code, _, err) = run_cli(
        broker.cli(&["journals", "apply", "-f", "-"]),
        long_part.as_bytes(),
    );
    assert_eq!(code, 2);
    assert!(err.contains("at most 255 bytes"), "{err}");
    let twice = b"- {name: cli/twice, flags: read-only}\n- {name: cli/twice}\n";
    let (code, _, err) = run_cli(broker.cli(&["journals", "apply", "-f", "-"]), twice);
    assert_eq!(code, 2);
    assert!(err.contains("named twice"), "{err}");
    let (code, _, err) = run_cli(broker.cli(&["journals", "list", "-l", "a="]), b"");
    assert_eq!(code, 2, "{err}");
    assert_eq!(list_yaml("").len(), 2);
}

/// An fsync-durability journal round-trips like any other. The power-loss
/// guarantee (fdatasync before the ack) cannot be tested by killing a
/// process — the page cache survives that — so only the round trip and
/// the spec are checked here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_journal_round_trip() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/fsync/journal";
    create_journal(&client, j, |s| s.durability = Durability::Fsync).await;
    let listed = client.list("").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].spec.durability, Durability::Fsync);

    let mut all = Vec::new();
    let contents = [
        b"one".to_vec(),
        pattern(APPEND_CHUNK_LEN + 1, 9),
        pattern(1, 1),
    ];
    let futs: Vec<_> = contents
        .iter()
        .map(|c| {
            let client = client.clone();
            let c = c.clone();
            tokio::spawn(async move { client.append(&append_req(j), c).await.unwrap() })
        })
        .collect();
    let mut replies = Vec::new();
    for f in futs {
        replies.push(f.await.unwrap());
    }
    // Concurrent appends commit whole, in some order, back to back.
    let mut order: Vec<usize> = (0..contents.len()).collect();
    order.sort_by_key(|&i| replies[i].begin);
    let mut at = 0;
    for &i in &order {
        assert_eq!(replies[i].begin, at);
        assert_eq!(replies[i].end, at + contents[i].len() as u64);
        assert_eq!(replies[i].sha1, sha1(&contents[i]));
        at = replies[i].end;
        all.extend_from_slice(&contents[i]);
    }
    assert_eq!(read_all(&client, j).await, all);
}

/// A client that does not route: requests sent to a shard that does not own
/// the journal are forwarded by the broker, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_to_the_wrong_shard_are_forwarded() {
    use rotary_net::wire::{self, flag, AppendReply, Op};
    use std::io::Write;
    let broker = Broker::start();
    let client = broker.client().await;
    let j = (0..)
        .map(|i| format!("e2e/forward/j{i}"))
        .find(|n| shard_of(n, broker.cores as u32) == 1)
        .unwrap();
    create_journal(&client, &j, |_| {}).await;
    let before = client.stats().await.unwrap()["cross_core_forwards"]
        .as_u64()
        .unwrap();

    let mut s = raw_connect(&broker.shard_endpoint(0));
    let meta = append_req(&j).encode();
    s.write_all(&frame(Op::APPEND, 0, 1, &meta, b"one frame;"))
        .unwrap();
    s.write_all(&frame(Op::APPEND, flag::MORE, 2, &meta, b"two "))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 2, &[], b"frames;"))
        .unwrap();
    let mut replies = Vec::new();
    for _ in 0..2 {
        let f = read_raw_frame(&mut s).unwrap().expect("APPEND_REPLY");
        assert_eq!((f.op, f.status), (Op::APPEND_REPLY, 0), "{f:?}");
        replies.push((f.request_id, AppendReply::decode(&f.meta).unwrap()));
    }
    replies.sort_by_key(|r| r.0);
    assert_eq!((replies[0].1.begin, replies[0].1.end), (0, 10));
    assert_eq!((replies[1].1.begin, replies[1].1.end), (10, 21));
    assert_eq!(replies[1].1.sha1, sha1(b"two frames;"));

    // A forwarded read, and a forwarded blocking read cancelled.
    let read = |offset: u64| {
        rotary_net::wire::ReadRequest {
            journal: j.clone(),
            offset: Some(offset),
            end_offset: None,
            route_revision: 0,
        }
        .encode()
    };
    s.write_all(&frame(Op::READ, 0, 3, &read(0), &[])).unwrap();
    let mut data = Vec::new();
    loop {
        let f = read_raw_frame(&mut s).unwrap().expect("READ reply");
        assert_eq!(f.request_id, 3);
        match f.op {
            Op::READ_DATA => data.extend_from_slice(&f.payload),
            Op::READ_DONE => {
                let d: wire::ReadDone = wire::decode_fixed(&f.meta, "done").unwrap();
                assert_eq!((f.status, d.offset.get(), d.write_head.get()), (0, 21, 21));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(data, b"one frame;two frames;");
    s.write_all(&frame(Op::READ, flag::BLOCK, 4, &read(21), &[]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    s.write_all(&frame(Op::CANCEL, 0, 4, &[], &[])).unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("READ_DONE");
    assert_eq!(
        (f.op, f.request_id, f.status),
        (Op::READ_DONE, 4, Status::CANCELLED as u16)
    );

    let after = client.stats().await.unwrap()["cross_core_forwards"]
        .as_u64()
        .unwrap();
    assert!(after >= before + 4, "forwards counted: {before} -> {after}");
    assert_eq!(read_all(&client, &j).await, b"one frame;two frames;");
}

/// `serve --cpus` keeps the whole broker on the cores it is given: shards,
/// uploader threads and the rings' io-wq workers alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_cpus_keeps_every_thread_of_the_broker_on_its_cores() {
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The last core, so that the mask differs from an unconfined process's.
    let core = online - 1;
    let broker = Broker::start_with(
        1,
        BrokerOpts {
            args: vec!["--cpus".into(), core.to_string()],
            ..Default::default()
        },
    );
    // An append makes the shard's ring start an io-wq worker or two.
    let client = broker.client().await;
    create_journal(&client, "e2e/cpus/j", |_| {}).await;
    let req = AppendRequest {
        journal: "e2e/cpus/j".into(),
        ..Default::default()
    };
    client.append(&req, vec![7u8; 1 << 20]).await.unwrap();
    let pid = broker.pid().expect("running");
    let threads: Vec<(String, String)> = per_thread(pid, "status", "Cpus_allowed_list")
        .into_iter()
        .map(|(comm, allowed)| (comm, allowed.unwrap_or_default()))
        .collect();
    assert!(
        threads.iter().any(|(c, _)| c.starts_with("rotary-shard")),
        "{threads:?}"
    );
    for (comm, allowed) in &threads {
        assert_eq!(allowed, &core.to_string(), "thread {comm}: {threads:?}");
    }
}

/// Each thread of `pid` by name, with the value of its `key` line in
/// `/proc/<pid>/task/<tid>/<file>` (`key: value` or `key   : value`), if
/// it has one.
fn per_thread(pid: u32, file: &str, key: &str) -> Vec<(String, Option<String>)> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let text = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        let value = text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        });
        threads.push((comm.trim().to_string(), value));
    }
    threads
}

/// Each thread's `se.slice` (ns), by name; threads of other policies than
/// SCHED_OTHER and SCHED_BATCH (the reaper's SCHED_IDLE) have none.
fn time_slices(pid: u32) -> Vec<(String, u64)> {
    per_thread(pid, "sched", "se.slice")
        .into_iter()
        .filter_map(|(comm, slice)| Some((comm, slice?.parse().ok()?)))
        .collect()
}

/// Shards ask the scheduler for 100 µs slices (so that a shard waking on a
/// busy core preempts what runs there), and so do the io-wq workers their
/// rings start, which run the writes the kernel cannot issue inline.
/// `--shard-slice` changes that, and 0 leaves them the kernel's default,
/// like the broker's other threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_threads_ask_for_short_time_slices() {
    let with = |args: &[&str]| {
        Broker::start_with(
            2,
            BrokerOpts {
                args: args.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            },
        )
    };
    for (args, want) in [
        (&[][..], Some(100_000)),
        (&["--shard-slice", "2ms"][..], Some(2_000_000)),
        (&["--shard-slice", "0"][..], None),
    ] {
        let broker = with(args);
        let threads = time_slices(broker.pid().expect("running"));
        let (shards, others): (Vec<_>, Vec<_>) = threads
            .iter()
            .partition(|(comm, _)| comm.starts_with("rotary-shard") || comm.starts_with("iou-wrk"));
        assert_eq!(
            shards
                .iter()
                .filter(|(comm, _)| comm.starts_with("rotary-shard"))
                .count(),
            2,
            "{args:?}: {threads:?}"
        );
        let default = others
            .iter()
            .find(|(comm, _)| comm == "rotary")
            .map(|(_, s)| *s)
            .unwrap_or_else(|| panic!("{args:?}: no main thread in {threads:?}"));
        for (comm, slice) in &shards {
            assert_eq!(
                *slice,
                want.unwrap_or(default),
                "{args:?}: {comm}: {threads:?}"
            );
        }
        assert!(
            others.iter().all(|(_, s)| *s == default),
            "{args:?}: only shards change their slice: {threads:?}"
        );
    }
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"));
    cmd.args(["serve", "--shard-slice", "50us"]);
    let (code, _, err) = run_cli(cmd, b"");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("must be 0, or from 100us to 100ms"), "{err}");
}

/// Offsets travel as i64, -1 meaning "no expected offset" on APPEND and
/// "the write head" on READ: an offset of 2^63 or more must be refused, by
/// the CLI and by the client library, never wrapped to -1 and sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_beyond_i64_are_refused_not_wrapped() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/cli/offset-limit";
    create_journal(&client, j, |_| {}).await;
    client
        .append(&append_req(j), b"abc".to_vec())
        .await
        .unwrap();

    // u64::MAX was -1 on the wire: committed at the head, fence defeated.
    for big in [
        "18446744073709551615",
        "9223372036854775808",
        "18446744073709551616",
    ] {
        let (code, out, err) = run_cli(broker.cli(&["append", j, "--offset", big]), b"fenced");
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty());
        assert!(
            err.contains(&format!(
                "{big} exceeds 9223372036854775807 (i64::MAX), the largest offset"
            )),
            "{err}"
        );
        let (code, out, err) = run_cli(broker.cli(&["read", j, "--offset", big]), b"");
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty());
        assert!(err.contains("9223372036854775807 (i64::MAX)"), "{err}");
    }
    assert_eq!(read_all(&client, j).await, b"abc");

    // The largest offset goes through unchanged: the head is not there.
    let (code, _, err) = run_cli(
        broker.cli(&["append", j, "--offset", "9223372036854775807"]),
        b"fenced",
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("error: WRONG_APPEND_OFFSET: "), "{err}");

    // -1 means the head for read; append has no such offset, and says how
    // to append without an expected offset instead of a parse failure.
    for args in [["--offset", "-1"].as_slice(), ["--offset=-1"].as_slice()] {
        let mut argv = vec!["append", j];
        argv.extend_from_slice(args);
        let (code, out, err) = run_cli(broker.cli(&argv), b"fenced");
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty());
        assert!(
            err.contains("append takes the write head it expects, 0 to 9223372036854775807; to append wherever the head is, leave --offset out"),
            "{err}"
        );
        assert!(!err.contains("invalid digit"), "{err}");
    }
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "-1", "--metadata"]),
        b"",
    );
    assert_eq!(code, 0, "{err}");
    let meta: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(meta, serde_json::json!({"offset": 3, "write_head": 3}));
    assert_eq!(read_all(&client, j).await, b"abc");

    // The client library refuses them before sending anything.
    let mut req = append_req(j);
    req.expect_offset = Some(u64::MAX);
    let err = client.append(&req, b"fenced".to_vec()).await.unwrap_err();
    assert!(
        matches!(
            err,
            rotary_net::client::ClientError::Offset(rotary_net::wire::WireError::OffsetTooLarge(
                u64::MAX
            ))
        ),
        "{err}"
    );
    let read = ReadRequest {
        journal: j.to_string(),
        offset: Some(rotary_net::wire::OFFSET_MAX + 1),
        end_offset: None,
        route_revision: 0,
    };
    let err = client.read(&read, false, false).await.unwrap_err();
    assert!(
        matches!(err, rotary_net::client::ClientError::Offset(_)),
        "{err}"
    );
    assert_eq!(read_all(&client, j).await, b"abc");

    // The expected head still fences.
    let (code, out, err) = run_cli(broker.cli(&["append", j, "--offset", "3"]), b"fenced");
    assert_eq!(code, 0, "{err}");
    let line: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        (line["begin"].as_u64(), line["end"].as_u64()),
        (Some(3), Some(9))
    );
    assert_eq!(read_all(&client, j).await, b"abcfenced");
}

/// Exit codes as the README's table gives them: 2 for invalid input,
/// whether the CLI or the broker finds it, 3 when a retry may succeed,
/// 1 otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_exit_codes_follow_the_readme() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/cli/exit-codes";
    create_journal(&client, j, |_| {}).await;

    // The broker refuses an empty append with register changes.
    let (code, out, err) = run_cli(broker.cli(&["append", j, "--union-registers", "k=v"]), b"");
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty());
    assert!(err.starts_with("error: BAD_REQUEST: "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let (code, out, err) = run_cli(broker.cli(&["append", j, "--union-registers", "k=v"]), b"x");
    assert_eq!(code, 0, "{err}");
    let line: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(line["registers"], serde_json::json!({"k": "v"}));

    // Endpoints that are not HOST:PORT are bad usage, not an unreachable
    // broker: no retry can help.
    let rotary = || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.env_remove("ROTARY_BROKER");
        cmd
    };
    for (bad, why) in [
        ("nonsense", "want HOST:PORT, e.g. 127.0.0.1:7401"),
        (
            "127.0.0.1:99999",
            "port \"99999\" is not a number from 1 to 65535",
        ),
        ("127.0.0.1:0", "port \"0\" is not a number from 1 to 65535"),
        (":7401", "want HOST:PORT with a host before the colon"),
    ] {
        for argv in [
            vec!["stats", "--broker", bad],
            vec!["append", j, "--broker", bad],
            vec!["read", j, "--pin", "--broker", bad],
        ] {
            let mut cmd = rotary();
            cmd.args(&argv);
            let (code, out, err) = run_cli(cmd, b"x");
            assert_eq!(code, 2, "{argv:?}: {err}");
            assert!(out.is_empty());
            assert_eq!(
                err,
                format!("error: BAD_USAGE: --broker {bad:?}: {why}\n"),
                "{argv:?}"
            );
        }
        let mut cmd = rotary();
        cmd.args(["stats"]).env("ROTARY_BROKER", bad);
        let (code, _, err) = run_cli(cmd, b"");
        assert_eq!(code, 2, "{err}");
        assert_eq!(
            err,
            format!("error: BAD_USAGE: ROTARY_BROKER {bad:?}: {why}\n")
        );
    }
    assert_eq!(read_all(&client, j).await, b"x");

    // A read range that ends where it begins, or before.
    for (offset, end) in [("1", "1"), ("5", "2")] {
        let (code, out, err) = run_cli(
            broker.cli(&["read", j, "--offset", offset, "--end-offset", end]),
            b"",
        );
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty());
        assert_eq!(
            err,
            format!(
                "error: BAD_USAGE: --end-offset {end} must be greater than --offset {offset}\n"
            )
        );
    }
    let (code, out, err) = run_cli(
        broker.cli(&["read", j, "--offset", "0", "--end-offset", "1"]),
        b"",
    );
    assert_eq!((code, out.as_slice()), (0, &b"x"[..]), "{err}");

    // A well-formed endpoint nobody listens on: retryable.
    let mut cmd = rotary();
    let dead = format!("127.0.0.1:{}", free_port_range(1));
    cmd.args(["append", j, "--broker", &dead]);
    let (code, _, err) = run_cli(cmd, b"y");
    assert_eq!(code, 3, "{err}");
    assert!(err.starts_with("error: UNAVAILABLE: "), "{err}");

    // A listener that accepts and never answers: retryable, not a hang.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mute_at = mute.local_addr().unwrap().to_string();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in mute.incoming().take(3) {
            conns.push(c);
        }
        std::thread::sleep(std::time::Duration::from_secs(15));
    });
    for argv in [
        vec!["stats", "--broker", &mute_at],
        vec!["append", j, "--broker", &mute_at],
        vec!["read", j, "--pin", "--broker", &mute_at],
    ] {
        let mut cmd = rotary();
        cmd.args(&argv);
        let (code, _, err) = run_cli(cmd, b"z");
        assert_eq!(code, 3, "{argv:?}: {err}");
        assert!(
            err.starts_with("error: UNAVAILABLE: ") && err.contains("no answer to PING"),
            "{argv:?}: {err}"
        );
    }
    drop(held);

    // Other refusals: 1.
    let (code, _, err) = run_cli(broker.cli(&["journals", "delete", "e2e/cli/none"]), b"");
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("error: JOURNAL_NOT_FOUND: "), "{err}");
    assert_eq!(read_all(&client, j).await, b"x");

    // A change whose result cannot be written out still happened: exit 4,
    // and the error says what was done, so that a script does not retry.
    let full = || std::fs::File::create("/dev/full").unwrap();
    let mut cmd = broker.cli(&["append", j]);
    cmd.stdin(std::process::Stdio::piped())
        .stdout(full())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"w").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(
        err.starts_with("error: OUTPUT_ERROR_AFTER_CHANGE: the append committed: ")
            && err.contains(r#""begin":1,"end":2"#)
            && err.trim_end().ends_with("do not retry"),
        "{err}"
    );
    assert_eq!(read_all(&client, j).await, b"xw");
    let out = broker
        .cli(&["journals", "delete", j])
        .stdout(full())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(
        err.starts_with(&format!(
            "error: OUTPUT_ERROR_AFTER_CHANGE: deleted {j}, but "
        )),
        "{err}"
    );
    // A data directory that is a file.
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = rotary();
    cmd.args(["serve", "--listen", "127.0.0.1:1", "--data"])
        .arg(file.path());
    let (code, _, err) = run_cli(cmd, b"");
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        err,
        format!(
            "error: BAD_USAGE: --data {}: not a directory\n",
            file.path().display()
        )
    );

    // Output that changes nothing is an ordinary failure.
    let out = broker
        .cli(&["journals", "list", "-o", "json"])
        .stdout(full())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: OUTPUT_ERROR: "), "{err}");
}

/// A journal without `fragment.stores` keeps its sealed fragments on the
/// broker's disk: `rotary fragments` says `local`, not an upload that
/// never comes. With a store, the state follows the upload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_of_a_journal_without_stores_are_local() {
    let broker = Broker::start();
    let client = broker.client().await;
    let store = tempfile::tempdir().unwrap();
    let local = "e2e/cli/frag-local";
    let stored = "e2e/cli/frag-stored";
    create_journal(&client, local, |_| {}).await;
    create_journal(&client, stored, |s| {
        s.fragment.stores = vec![format!("file://{}/", store.path().display())];
    })
    .await;

    let state_column = |name: &str| -> Vec<(String, String, String)> {
        let (code, out, err) = run_cli(broker.cli(&["fragments", name]), b"");
        assert_eq!(code, 0, "{err}");
        let text = String::from_utf8(out).unwrap();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(header[6], "STATE", "{text}");
        lines
            .map(|l| {
                let cells: Vec<&str> = l.split_whitespace().collect();
                (cells[0].into(), cells[1].into(), cells[6].into())
            })
            .collect()
    };
    let row = |b: &str, e: &str, s: &str| (b.to_string(), e.to_string(), s.to_string());

    for j in [local, stored] {
        client
            .append(&append_req(j), b"sealed".to_vec())
            .await
            .unwrap();
        let (code, _, err) = run_cli(broker.cli(&["journals", "seal", j]), b"");
        assert_eq!(code, 0, "{err}");
        client
            .append(&append_req(j), b"open".to_vec())
            .await
            .unwrap();
    }

    assert_eq!(
        state_column(local),
        [row("0", "6", "local"), row("6", "10", "open")]
    );
    let (code, out, err) = run_cli(broker.cli(&["fragments", local, "-o", "json"]), b"");
    assert_eq!(code, 0, "{err}");
    let frags: Vec<serde_json::Value> = serde_json::from_slice(&out).unwrap();
    assert_eq!(frags.len(), 2, "{frags:?}");
    assert!(
        frags.iter().all(|f| f.get("uploaded").is_none()),
        "{frags:?}"
    );
    assert_eq!(frags[0]["store"], "local");

    // With a store: uploading, then uploaded (and the store's object).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let rows = state_column(stored);
        assert!(
            matches!(rows[0].2.as_str(), "uploading" | "uploaded"),
            "{rows:?}"
        );
        if rows.contains(&row("0", "6", "uploaded")) {
            assert!(rows.contains(&row("6", "10", "open")), "{rows:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not uploaded after 30 s: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A data directory takes its shard count from its first start that gets
/// as far as listening: a first start that fails on a busy port fixes
/// nothing, and a later start with another `--cores` is then free to.
/// Once a start has succeeded, other counts are refused with the count to
/// use.
#[test]
fn a_failed_first_start_does_not_fix_the_shard_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = held.local_addr().unwrap().to_string();
    let serve = |cores: &str, listen: &str| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rotary"));
        cmd.args(["serve", "--data"])
            .arg(&data)
            .args(["--cores", cores, "--listen", listen]);
        cmd
    };
    let out = serve("2", &busy).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Address already in use"), "{err}");
    assert!(!data.join("broker.json").exists());
    drop(held);

    // Another count on the same directory now starts.
    let port = free_port_range(1);
    let mut child = serve("1", &format!("127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let endpoint = format!("127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !raw_ping(&endpoint) {
        assert!(
            std::time::Instant::now() < deadline,
            "no broker on {endpoint}"
        );
        assert!(child.try_wait().unwrap().is_none(), "the broker exited");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    let _ = child.wait();
    let recorded: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("broker.json")).unwrap()).unwrap();
    assert_eq!(recorded["shards"], 1);

    // And from now on that count is the directory's.
    let port = free_port_range(2);
    let out = serve("2", &format!("127.0.0.1:{port}")).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("was created with 1 shards; start with --cores 1"),
        "{err}"
    );
}
