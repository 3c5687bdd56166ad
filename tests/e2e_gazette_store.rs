//! End-to-end: a fragment store written in Gazette's names is history that a
//! real broker serves whole.
//!
//! The fixture is made here by hand from Gazette's naming rules, not from
//! rotary's table: an object `<journal>/[<key=value>/]<begin:016x>-<end:016x>-<sha1><ext>`
//! holds the bytes `[begin, end)`, compressed as its extension says,
//! matched ignoring case: `.raw` none; `.gz`, `.gzip` gzip (Gazette writes
//! a member per batch: several); `.zst`, `.zstandard` zstd; `.sz`,
//! `.snappy` snappy's framing format; no extension or `.gzod`
//! GZIP_OFFLOAD_DECOMPRESSION: one gzip member, held by S3 with
//! `Content-Encoding: gzip` (a file holds the gzip bytes alone). A broker
//! with an empty disk reads it through itself and lets the client read it
//! straight from the store: the same bytes and SHA-1 at the same offsets.
//! On S3 the broker then writes GZIP_OFFLOAD_DECOMPRESSION fragments as
//! Gazette does; a file store refuses that codec, as Gazette's specs do.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::store::TestStore;
use common::*;
use rotary_net::client::Client;
use rotary_net::spec::{parse_specs, Codec, JournalSpec};
use rotary_net::wire::AppendRequest;
use rotary_net::Status;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const JOURNAL: &str = "gazette/mixed";
/// Bound on every wait for the broker (listings, uploads).
const WAIT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);

/// Each spelling of an extension Gazette reads, and the codec it names.
const SPELLINGS: [(&str, Codec); 17] = [
    (".raw", Codec::None),
    (".gz", Codec::Gzip),
    (".gzip", Codec::Gzip),
    (".zst", Codec::Zstd),
    (".zstandard", Codec::Zstd),
    (".sz", Codec::Snappy),
    (".snappy", Codec::Snappy),
    ("", Codec::GzipOffload),
    (".gzod", Codec::GzipOffload),
    (".RAW", Codec::None),
    (".GZ", Codec::Gzip),
    (".Gzip", Codec::Gzip),
    (".ZST", Codec::Zstd),
    (".ZStandard", Codec::Zstd),
    (".SZ", Codec::Snappy),
    (".SNAPPY", Codec::Snappy),
    (".GZOD", Codec::GzipOffload),
];
/// The fixture object under a postfix directory, and the one whose name
/// has upper-case hex digits (both Gazette-legal).
const POSTFIXED: usize = 4;
const UPPER_HEX: usize = 8;

/// One object of the fixture.
#[derive(Debug)]
struct Object {
    key: String,
    begin: u64,
    end: u64,
    codec: Codec,
}

/// A journal's history as Gazette would have left it in a store.
struct Fixture {
    bytes: Vec<u8>,
    objects: Vec<Object>,
}

/// Journal-like bytes: runs of text between random ones.
fn content(seed: u32, len: usize) -> Vec<u8> {
    let noise = record(seed, 3, len);
    (0..len)
        .map(|i| {
            if (i / 48) % 3 == 0 {
                noise[i]
            } else {
                b"gazette fragment "[i % 17]
            }
        })
        .collect()
}

fn gzip_member(raw: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(raw).unwrap();
    enc.finish().unwrap()
}

/// The object's bytes, as a Gazette writer of `codec` makes them, each
/// format by its own library.
fn gazette_bytes(codec: Codec, raw: &[u8]) -> Vec<u8> {
    match codec {
        Codec::None => raw.to_vec(),
        Codec::Gzip => raw
            .chunks(raw.len() / 3 + 1)
            .flat_map(gzip_member)
            .collect(),
        Codec::GzipOffload => gzip_member(raw),
        Codec::Zstd => zstd::encode_all(raw, 3).unwrap(),
        Codec::Snappy => {
            let mut enc = snap::write::FrameEncoder::new(Vec::new());
            enc.write_all(raw).unwrap();
            enc.into_inner().unwrap()
        }
    }
}

/// Writes the fixture: one object per spelling, back to back from offset 0.
fn build_fixture(store: &TestStore) -> Fixture {
    let mut bytes = Vec::new();
    let mut objects = Vec::new();
    for (i, (ext, codec)) in SPELLINGS.into_iter().enumerate() {
        let raw = content(i as u32, 3000 + 1733 * i);
        let (begin, end) = (bytes.len() as u64, (bytes.len() + raw.len()) as u64);
        let mut sha1 = hex_sha1(&raw);
        if i == UPPER_HEX {
            sha1 = sha1.to_uppercase();
        }
        let postfix = if i == POSTFIXED { "pivot=1/" } else { "" };
        let key = format!("{JOURNAL}/{postfix}{begin:016x}-{end:016x}-{sha1}{ext}");
        let encoding = (codec == Codec::GzipOffload).then_some("gzip");
        store.put(&key, &gazette_bytes(codec, &raw), encoding);
        bytes.extend_from_slice(&raw);
        objects.push(Object {
            key,
            begin,
            end,
            codec,
        });
    }
    Fixture { bytes, objects }
}

fn cli_ok(broker: &Broker, args: &[&str], stdin: &[u8]) -> Vec<u8> {
    let (code, out, err) = run_cli(broker.cli(args), stdin);
    assert_eq!(code, 0, "rotary {args:?}: {err}");
    out
}

/// The journal's spec as YAML, naming the codec as given.
fn spec_yaml(store: &TestStore, codec: &str) -> String {
    format!(
        "name: {JOURNAL}\nfragment:\n  length: 65536\n  compression_codec: {codec}\n  \
         refresh_interval: 1s\n  stores:\n    - '{}'\n",
        store.url()
    )
}

/// Applies the spec through the CLI with the codec's Gazette name, and
/// checks `journals list -o yaml` prints rotary's name for it, in a form
/// that applies back unchanged.
fn apply_with_gazette_name(broker: &Broker, store: &TestStore, codec: Codec) -> JournalSpec {
    let yaml = spec_yaml(store, codec.gazette_name());
    cli_ok(broker, &["journals", "apply", "-f", "-"], yaml.as_bytes());
    let want = parse_specs(&yaml).unwrap().remove(0);
    assert_eq!(want.fragment.compression_codec, codec);
    let out = cli_ok(broker, &["journals", "list", "-o", "yaml"], b"");
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains(&format!("compression_codec: {}\n", codec.name())),
        "{text}"
    );
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    for v in doc.as_sequence_mut().expect("a list") {
        v.as_mapping_mut().unwrap().remove("revision");
    }
    let listed = parse_specs(&serde_yaml::to_string(&doc).unwrap()).unwrap();
    assert_eq!(listed, vec![want.clone()]);
    want
}

/// FRAGMENTS lists every fixture object, with its codec and key as written.
async fn check_listed(client: &Client, fixture: &Fixture) {
    let frags = client.fragments(JOURNAL).await.expect("fragments");
    assert_eq!(frags.len(), fixture.objects.len(), "{frags:#?}");
    for (f, o) in frags.iter().zip(&fixture.objects) {
        assert_eq!(
            (f.begin, f.end, f.codec),
            (o.begin, o.end, o.codec),
            "{o:?}"
        );
        assert_eq!(f.key.as_deref(), Some(o.key.as_str()));
        assert_eq!(
            f.sha1,
            hex_sha1(&fixture.bytes[o.begin as usize..o.end as usize])
        );
        assert_ne!(f.store, "local");
    }
}

/// A proxied read of `[from, head)`, retried while the store is not yet
/// listed.
async fn read_proxied(client: &Client, from: u64) -> Vec<u8> {
    let deadline = Instant::now() + WAIT;
    loop {
        match read_range(client, JOURNAL, from, None).await {
            Ok((bytes, done)) => {
                assert_eq!(done.status, Status::OK, "{done:?}");
                assert_eq!(done.offset, from + bytes.len() as u64);
                assert_eq!(done.write_head, done.offset, "{done:?}");
                return bytes;
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(POLL).await;
            }
            Err(e) => panic!("proxied read from {from}: {e}"),
        }
    }
}

/// The journal read back every way: proxied (whole, and from inside the
/// gzip-offload fragment without extension), directly by the client, and
/// by the CLI both ways. Each is `want` exactly.
async fn check_read_back(broker: &Broker, client: &Client, fixture: &Fixture, want: &[u8]) {
    let proxied = read_proxied(client, 0).await;
    assert_eq!(hex_sha1(&proxied), hex_sha1(want), "proxied");
    assert!(proxied == want, "proxied: {} bytes", proxied.len());
    let offload = fixture
        .objects
        .iter()
        .find(|o| o.codec == Codec::GzipOffload && !o.key.contains('.'))
        .expect("an object without extension");
    let mid = offload.begin + 1001;
    assert!(mid < offload.end);
    assert!(read_proxied(client, mid).await == want[mid as usize..]);
    let (direct, fetched) = read_direct(client, JOURNAL, 0).await;
    assert_eq!(hex_sha1(&direct), hex_sha1(want), "direct");
    assert!(direct == want, "direct: {} bytes", direct.len());
    // Every fixture object came straight from the store.
    let objects = fixture.objects.len() as u64;
    assert!(
        fetched >= objects,
        "{fetched} of {objects} fragments fetched"
    );
    let out = cli_ok(broker, &["read", JOURNAL], b"");
    assert!(out == want, "rotary read: {} bytes", out.len());
    let out = cli_ok(broker, &["read", JOURNAL, "--proxy"], b"");
    assert!(out == want, "rotary read --proxy: {} bytes", out.len());
}

/// Builds the fixture in `store`, starts a broker on an empty disk with the
/// journal's spec (`codec` named as Gazette names it), and reads the whole
/// journal back.
async fn gazette_store_is_read_whole(store: &TestStore, codec: Codec) -> (Broker, Fixture) {
    let fixture = build_fixture(store);
    let broker = Broker::start_with(
        CORES_DEFAULT,
        BrokerOpts {
            env: store.broker_env(),
            ..Default::default()
        },
    );
    apply_with_gazette_name(&broker, store, codec);
    let client = broker.client().await;
    check_listed(&client, &fixture).await;
    check_read_back(&broker, &client, &fixture, &fixture.bytes).await;
    (broker, fixture)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gazette_file_store_is_read_whole() {
    let store = TestStore::file();
    let (broker, _fixture) = gazette_store_is_read_whole(&store, Codec::Snappy).await;

    // Gzip-offload is not written to a file store: refused, in either
    // name, and the journal keeps its spec.
    for name in ["GZIP_OFFLOAD_DECOMPRESSION", "gzip_offload_decompression"] {
        let yaml = spec_yaml(&store, name);
        let (code, _, err) = run_cli(
            broker.cli(&["journals", "apply", "-f", "-"]),
            yaml.as_bytes(),
        );
        assert_eq!(code, 2, "{err}");
        assert!(
            err.starts_with("error: BAD_REQUEST: ")
                && err.contains("gzip_offload_decompression")
                && err.contains("s3://"),
            "{err}"
        );
    }
    let client = broker.client().await;
    let mut spec = parse_specs(&spec_yaml(&store, "snappy")).unwrap().remove(0);
    spec.fragment.compression_codec = Codec::GzipOffload;
    let e = client.apply(&[spec]).await.unwrap_err();
    assert_eq!(e.status(), Some(Status::BAD_REQUEST), "{e}");
    let listed = client.list("").await.unwrap();
    assert_eq!(listed[0].spec.fragment.compression_codec, Codec::Snappy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gazette_s3_store_is_read_whole_and_written_as_gazette_writes() {
    let store = TestStore::s3("gazette/");
    let (broker, fixture) = gazette_store_is_read_whole(&store, Codec::GzipOffload).await;
    for o in &fixture.objects {
        let want = (o.codec == Codec::GzipOffload).then(|| "gzip".to_string());
        assert_eq!(store.content_encoding(&o.key), want, "{}", o.key);
    }

    // The broker continues the journal at the store's end and uploads its
    // fragment as Gazette would: gzip bytes under a name without
    // extension, with Content-Encoding: gzip.
    let head = fixture.bytes.len() as u64;
    let out = cli_ok(&broker, &["journals", "reset-head", JOURNAL], b"");
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["write_head"], head, "{v}");
    let client = broker.client().await;
    let tail = content(99, 40_000);
    let req = AppendRequest {
        journal: JOURNAL.to_string(),
        ..Default::default()
    };
    let r = client.append(&req, tail.clone()).await.expect("append");
    assert_eq!((r.begin, r.end), (head, head + tail.len() as u64));
    cli_ok(&broker, &["journals", "seal", JOURNAL], b"");
    let key = format!("{JOURNAL}/{head:016x}-{:016x}-{}", r.end, hex_sha1(&tail));
    let deadline = Instant::now() + WAIT;
    while !store.list(&key).iter().any(|(k, _)| *k == key) {
        assert!(
            Instant::now() < deadline,
            "{key} not uploaded: {:?}",
            store.list("")
        );
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(store.content_encoding(&key).as_deref(), Some("gzip"));
    let object = store.get(&key);
    assert_eq!(&object[..2], &[0x1f, 0x8b], "gzip's magic");
    let mut unzipped = Vec::new();
    flate2::read::GzDecoder::new(&object[..])
        .read_to_end(&mut unzipped)
        .unwrap();
    assert!(unzipped == tail, "the object gunzips to the appended bytes");

    let mut want = fixture.bytes.clone();
    want.extend_from_slice(&tail);
    check_read_back(&broker, &client, &fixture, &want).await;
}
