//! End-to-end: registers as a fence between writers, against a real broker.
//! A union replaces a name's values, a subtract removes a name only when all
//! of its values are given, and subtract applies before union
//! (docs/PROTOCOL.md §6.2).
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_net::client::Client;
use rotary_net::spec::{LabelSelector, LabelSet};
use rotary_net::wire::Op;
use rotary_net::wire::{AppendReply, AppendRequest};
use rotary_net::Status;

/// `name=value,…`; a name without `=` has the empty value.
fn labels(text: &str) -> LabelSet {
    let mut set = LabelSet::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (n, v) = part.split_once('=').unwrap_or((part, ""));
        set.add(n.into(), v.into()).unwrap();
    }
    set
}

/// An append to `journal` with these preconditions and changes ("" for
/// none).
fn req(journal: &str, check: &str, subtract: &str, union: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        check_registers: LabelSelector::parse(check).unwrap(),
        subtract_registers: labels(subtract),
        union_registers: labels(union),
        ..Default::default()
    }
}

async fn append_ok(client: &Client, r: &AppendRequest, bytes: &[u8]) -> AppendReply {
    client
        .append(r, bytes.to_vec())
        .await
        .unwrap_or_else(|e| panic!("append {r:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_writer_is_fenced_by_the_new_writers_union() {
    let broker = Broker::start();
    // Two writers, each on its own connection.
    let a = broker.client().await;
    let b = broker.client().await;
    let j = "e2e/registers/fence";
    create_journal(&a, j, |_| {}).await;

    // A takes the journal.
    let r = append_ok(&a, &req(j, "", "", "author=a"), b"a1;").await;
    assert_eq!((r.begin, r.end), (0, 3));
    assert_eq!(r.registers, labels("author=a"));
    let r = append_ok(&a, &req(j, "author=a", "", ""), b"a2;").await;
    assert_eq!((r.begin, r.end), (3, 6));

    // B takes it over by union alone: author=a is replaced, not kept.
    let r = append_ok(&b, &req(j, "", "", "author=b"), b"b1;").await;
    assert_eq!((r.begin, r.end), (6, 9));
    assert_eq!(r.registers, labels("author=b"));

    // A's next append, checked against what A believes, is refused with
    // the current registers and head, and commits nothing.
    let err = a
        .append(&req(j, "author=a", "", "author=a"), b"a3;".to_vec())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(Status::REGISTER_MISMATCH), "{err}");
    assert!(!err.is_retryable());
    let reply = err
        .append_reply()
        .expect("REGISTER_MISMATCH carries the reply");
    assert_eq!(reply.registers, labels("author=b"));
    assert_eq!(reply.begin, reply.end);
    assert_eq!(reply.write_head, 9);

    // B's own checked append commits right after it.
    let r = append_ok(&b, &req(j, "author=b", "", ""), b"b2;").await;
    assert_eq!((r.begin, r.end, r.write_head), (9, 12, 12));
    assert_eq!(r.registers, labels("author=b"));

    assert_eq!(read_all(&a, j).await, b"a1;a2;b1;b2;".to_vec());
    // The head and registers as any client sees them now.
    let r = append_ok(&a, &req(j, "", "", ""), b"").await;
    assert_eq!((r.begin, r.end, r.write_head), (12, 12, 12));
    assert_eq!(r.registers, labels("author=b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subtract_applies_before_union_and_only_to_whole_names() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/registers/order";
    create_journal(&client, j, |_| {}).await;

    // With no registers, a check for a value is a mismatch and one for an
    // absent name matches.
    let err = client
        .append(&req(j, "author=a", "", ""), b"x".to_vec())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(Status::REGISTER_MISMATCH), "{err}");
    assert!(err.append_reply().unwrap().registers.is_empty());
    let r = append_ok(&client, &req(j, "!author", "", "author=a,epoch=7"), b"0").await;
    assert_eq!(r.registers, labels("author=a,epoch=7"));

    // Subtract then union of one value keeps it.
    let r = append_ok(&client, &req(j, "", "author=a", "author=a"), b"1").await;
    assert_eq!(r.registers, labels("author=a,epoch=7"));

    // An empty subtract value removes nothing but an empty value.
    let r = append_ok(&client, &req(j, "", "author", ""), b"2").await;
    assert_eq!(r.registers, labels("author=a,epoch=7"));

    // A name with two values goes only when both are given.
    let r = append_ok(&client, &req(j, "", "", "tag=x,tag=y"), b"3").await;
    assert_eq!(r.registers, labels("author=a,epoch=7,tag=x,tag=y"));
    let r = append_ok(&client, &req(j, "", "tag=x", ""), b"4").await;
    assert_eq!(r.registers, labels("author=a,epoch=7,tag=x,tag=y"));
    let r = append_ok(&client, &req(j, "", "tag=x,tag=y", ""), b"5").await;
    assert_eq!(r.registers, labels("author=a,epoch=7"));

    // A union replaces every value of its names, an empty one too.
    let r = append_ok(&client, &req(j, "", "", "tag=z"), b"6").await;
    assert_eq!(r.registers, labels("author=a,epoch=7,tag=z"));
    let r = append_ok(&client, &req(j, "", "", "tag"), b"7").await;
    assert_eq!(r.registers, labels("author=a,epoch=7,tag"));
    let r = append_ok(&client, &req(j, "", "tag", ""), b"8").await;
    assert_eq!(r.registers, labels("author=a,epoch=7"));

    // Gazette's register sequence (broker/append_api_test.go), from here.
    let r = append_ok(
        &client,
        &req(j, "", "author=a,epoch=7", "AA=11,BB=22"),
        b"9",
    )
    .await;
    assert_eq!(r.registers, labels("AA=11,BB=22"));
    let r = append_ok(
        &client,
        &req(j, "AA in (11), BB", "AA=11,BB=XYZ", "CC=33"),
        b"a",
    )
    .await;
    assert_eq!(r.registers, labels("BB=22,CC=33"));
    let r = append_ok(&client, &req(j, "!AA, CC", "CC=33", "AA=44"), b"b").await;
    assert_eq!(r.registers, labels("AA=44,BB=22"));
    let err = client
        .append(&req(j, "AA = 55", "", "ZZZ"), b"c".to_vec())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(Status::REGISTER_MISMATCH), "{err}");
    assert_eq!(err.append_reply().unwrap().registers, labels("AA=44,BB=22"));

    // The CLI's flags mean the same.
    let (code, out, err) = run_cli(
        broker.cli(&[
            "append",
            j,
            "--check-registers",
            "AA=44",
            "--subtract-registers",
            "BB=22",
            "--union-registers",
            "AA=45",
        ]),
        b"d",
    );
    assert_eq!(code, 0, "{err}");
    let line: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(line["registers"], serde_json::json!({"AA": "45"}));
    assert_eq!(read_all(&client, j).await, b"0123456789abd".to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_selects_journals_by_the_meta_labels_name_and_prefix() {
    let broker = Broker::start();
    let client = broker.client().await;
    for j in [
        "meta/orders/part-000",
        "meta/orders/part-001",
        "meta/ordersx/part-000",
    ] {
        create_journal(&client, j, |s| s.labels = labels("app=orders")).await;
    }
    let names = |list: Vec<rotary_net::client::JournalInfo>| -> Vec<String> {
        list.into_iter().map(|i| i.spec.name).collect()
    };
    let list = client.list("prefix=meta/orders/").await.unwrap();
    assert_eq!(
        names(list),
        ["meta/orders/part-000", "meta/orders/part-001"]
    );
    let list = client.list("name=meta/orders/part-001").await.unwrap();
    assert_eq!(names(list), ["meta/orders/part-001"]);
    let list = client
        .list("app=orders,prefix=meta/,name!=meta/orders/part-000")
        .await
        .unwrap();
    assert_eq!(
        names(list),
        ["meta/orders/part-001", "meta/ordersx/part-000"]
    );

    // A prefix without its trailing '/' is refused by the broker too.
    let reply = {
        let mut s = raw_connect(&broker.endpoint());
        let body = br#"{"selector":"prefix=meta/orders"}"#;
        std::io::Write::write_all(&mut s, &frame(Op::LIST, 0, 1, &[], body)).unwrap();
        read_raw_frame(&mut s).unwrap().unwrap()
    };
    assert_eq!(reply.status, Status::BAD_REQUEST as u16);

    // A spec may not carry `name` or `prefix` as labels.
    for label in ["name=meta/x", "prefix=meta/"] {
        let mut spec = rotary_net::spec::JournalSpec::new("meta/labelled");
        spec.labels = labels(label);
        let err = client.apply(&[spec]).await.unwrap_err();
        assert_eq!(err.status(), Some(Status::BAD_REQUEST), "{label}: {err}");
        assert!(err.to_string().contains("cannot include label"), "{err}");
    }
    assert!(client
        .list("prefix=meta/labelled/")
        .await
        .unwrap()
        .is_empty());
}
