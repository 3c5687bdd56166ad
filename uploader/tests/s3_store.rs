//! The uploader against a real S3 endpoint: `moto_server` on loopback,
//! started per test and killed by its guard (also on panic).
//!
//! The server is found via `ROTARY_MOTO_SERVER`, else at
//! `/tmp/rotary-moto/bin/moto_server`. Without it these tests fail, saying
//! how to install it; CI installs it.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_proto::spec::Codec;
use rotary_uploader::{StoreError, StoredFragment, Uploader};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const MOTO_DEFAULT: &str = "/tmp/rotary-moto/bin/moto_server";
const MOTO_START_WAIT: Duration = Duration::from_secs(60);
const BUCKET: &str = "rotary-test";
const PREFIX: &str = "pre/fix/";
/// moto checks no signatures, but refuses reads that carry no credentials.
const MOTO_AUTH: &str = "Authorization: AWS4-HMAC-SHA256 \
    Credential=test/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00\r\n";

fn moto_binary() -> PathBuf {
    let path = std::env::var_os("ROTARY_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(MOTO_DEFAULT));
    assert!(
        path.is_file(),
        "the S3 tests need moto_server, not found at {}: install it with \
         `python3 -m venv /tmp/rotary-moto && /tmp/rotary-moto/bin/pip install 'moto[server]'` \
         or point ROTARY_MOTO_SERVER at it",
        path.display()
    );
    path
}

/// Credentials and region for every store of this process, set before any
/// store is built (each test calls this first).
fn aws_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
        std::env::set_var("AWS_REGION", "us-east-1");
    });
}

/// A free port that no other test of this process was given. A test that
/// stops its server and starts it again on the same port leaves that port
/// free in between, and the kernel may offer it to another test's `bind(0)`.
fn unused_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A running moto server; killed by PID when dropped.
struct Moto {
    child: Child,
    port: u16,
    log: tempfile::NamedTempFile,
}

impl Moto {
    fn start() -> Moto {
        Moto::start_on(unused_port())
    }

    fn start_on(port: u16) -> Moto {
        aws_env();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(moto_binary())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("start moto_server");
        let mut moto = Moto { child, port, log };
        let deadline = Instant::now() + MOTO_START_WAIT;
        loop {
            if let Some(status) = moto.child.try_wait().unwrap() {
                panic!("moto_server exited ({status}): {}", moto.log_text());
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                let (status, _) = http("GET", &format!("{}/", moto.endpoint()), b"");
                if status == 200 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer: {}",
                moto.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // CreateBucket: moto takes an unsigned path-style PUT.
        let (status, body) = http("PUT", &format!("{}/{BUCKET}", moto.endpoint()), b"");
        assert_eq!(
            status,
            200,
            "create bucket: {}",
            String::from_utf8_lossy(&body)
        );
        moto
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn store(&self) -> String {
        format!(
            "s3://{BUCKET}/{PREFIX}?endpoint={}&region=us-east-1&path_style=true",
            self.endpoint()
        )
    }

    /// The object's URL, path-style, for plain (unsigned) requests.
    fn object_url(&self, key: &str) -> String {
        format!("{}/{BUCKET}/{PREFIX}{key}", self.endpoint())
    }

    fn get(&self, key: &str) -> Option<Vec<u8>> {
        match http_with("GET", &self.object_url(key), MOTO_AUTH, b"") {
            (200, body) => Some(body),
            (404, _) => None,
            (status, body) => panic!("GET {key}: {status} {}", String::from_utf8_lossy(&body)),
        }
    }

    fn put(&self, key: &str, bytes: &[u8]) {
        self.put_with(key, "", bytes);
    }

    /// [`Moto::put`] with extra header lines (each ending in `\r\n`).
    fn put_with(&self, key: &str, headers: &str, bytes: &[u8]) {
        let headers = format!("{MOTO_AUTH}{headers}");
        let (status, body) = http_with("PUT", &self.object_url(key), &headers, bytes);
        assert_eq!(status, 200, "PUT {key}: {}", String::from_utf8_lossy(&body));
    }

    /// GET of the object: its response head and stored bytes.
    fn get_with_head(&self, key: &str) -> (String, Vec<u8>) {
        let (status, head, body) = http_exchange("GET", &self.object_url(key), MOTO_AUTH, b"");
        assert_eq!(status, 200, "GET {key}: {}", String::from_utf8_lossy(&body));
        (head, body)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    fn stop(mut self) -> u16 {
        self.kill();
        self.port
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}

fn setup() -> (Moto, Uploader, tempfile::TempDir) {
    let moto = Moto::start();
    (moto, Uploader::start(2, 8), tempfile::tempdir().unwrap())
}

#[test]
fn every_codec_round_trips() {
    let (moto, up, local) = setup();
    let store = moto.store();
    for (i, codec) in CODECS.into_iter().enumerate() {
        let f = Fragment::write(
            local.path(),
            "orders/part-000",
            1000 * i as u64,
            data(300_000, i as u64),
        );
        let stored = upload_ok(&up, &f, codec, &store);
        // At the exact key under the prefix; the codec's own library
        // decodes it to bytes of the named SHA-1.
        let object = moto.get(&f.key(codec)).expect("object at its key");
        assert_eq!(stored.size, object.len() as u64);
        let raw = decompress(codec, &object);
        let sha1: [u8; 20] =
            sha1::Digest::finalize(<sha1::Sha1 as sha1::Digest>::new_with_prefix(&raw)).into();
        assert_eq!(sha1, f.sha1, "{codec:?}");
        assert_eq!(raw, f.data);
    }
    assert_eq!(
        up.metrics().uploads.load(Ordering::Relaxed),
        CODECS.len() as u64
    );
}

#[test]
fn reupload_is_skipped() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "a/journal", 0, data(10_000, 1));
    let first = upload_ok(&up, &f, Codec::Gzip, &store);
    let second = upload_ok(&up, &f, Codec::Gzip, &store);
    assert_eq!(first.size, second.size);
    assert_eq!(up.metrics().uploads.load(Ordering::Relaxed), 1);
    assert_eq!(up.metrics().skipped_existing.load(Ordering::Relaxed), 1);
}

#[test]
fn listing_is_exactly_the_journals_fragments() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let ab0 = Fragment::write(local.path(), "jr/a/b", 0, data(5000, 1));
    let ab1 = Fragment::write(local.path(), "jr/a/b", 5000, data(7000, 2));
    let abc = Fragment::write(local.path(), "jr/a/b/c", 0, data(3000, 3));
    let abx = Fragment::write(local.path(), "jr/a/bc", 0, data(3000, 4));
    let want0 = upload_ok(&up, &ab0, Codec::Zstd, &store);
    let want1 = upload_ok(&up, &ab1, Codec::None, &store);
    let child = upload_ok(&up, &abc, Codec::Zstd, &store);
    upload_ok(&up, &abx, Codec::Snappy, &store);

    let postfixed = Fragment::write(local.path(), "jr/a/b", 12_000, data(100, 5));
    let name = postfixed
        .key(Codec::None)
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    for rel in [
        "jr/a/b/pivot=1",
        "jr/a/b/other",
        "jr/a/b/pivot=1/deeper",
        "jr/a/b/c/pivot=2",
    ] {
        moto.put(&format!("{rel}/{name}"), &postfixed.data);
    }
    moto.put("jr/a/b/README", b"not a fragment");
    // Outside the store's prefix entirely.
    let (status, _) = http(
        "PUT",
        &format!("{}/{BUCKET}/jr/a/b/{name}", moto.endpoint()),
        &postfixed.data,
    );
    assert_eq!(status, 200);

    let listed = block_on(up.list(&store, "jr/a/b")).unwrap();
    let keys: Vec<&str> = listed.iter().map(|f| f.key.as_str()).collect();
    let postfix_key = format!("jr/a/b/pivot=1/{name}");
    assert_eq!(
        keys,
        vec![want0.key.as_str(), want1.key.as_str(), postfix_key.as_str()]
    );
    assert_eq!(
        (listed[0].size, listed[1].size, listed[2].size),
        (want0.size, want1.size, 100)
    );
    assert!(listed
        .iter()
        .all(|f| f.store == store && f.journal == "jr/a/b"));

    let listed = block_on(up.list(&store, "jr/a/b/c")).unwrap();
    let keys: Vec<&str> = listed.iter().map(|f| f.key.as_str()).collect();
    let child_postfix = format!("jr/a/b/c/pivot=2/{name}");
    assert_eq!(keys, vec![child.key.as_str(), child_postfix.as_str()]);

    assert!(block_on(up.list(&store, "never/written"))
        .unwrap()
        .is_empty());
}

#[test]
fn read_streams_exact_bytes_from_the_middle() {
    let (moto, up, local) = setup();
    let store = moto.store();
    for (i, codec) in CODECS.into_iter().enumerate() {
        let begin = 1 << 30;
        let f = Fragment::write(
            local.path(),
            &format!("reads/{i:03}"),
            begin,
            data(500_000, 10 + i as u64),
        );
        let stored = upload_ok(&up, &f, codec, &store);
        let from = begin + 250_001;
        let (chunks, err) = read_all(&up, &stored, from, 32 << 10);
        assert!(err.is_none(), "{codec:?}: {err:?}");
        assert_eq!(
            concat(&chunks, from, 32 << 10),
            f.data[(from - begin) as usize..],
            "{codec:?}"
        );
    }
    // Several ranged GETs (8 MiB each).
    let f = Fragment::write(local.path(), "reads/big", 0, data(9 << 20, 99));
    let stored = upload_ok(&up, &f, Codec::None, &store);
    let from = (8 << 20) + 17;
    let (chunks, err) = read_all(&up, &stored, from, 1 << 20);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(concat(&chunks, from, 1 << 20), f.data[from as usize..]);
}

#[test]
fn tampered_objects_are_refused() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "tamper/raw", 0, data(100_000, 3));
    let stored = upload_ok(&up, &f, Codec::None, &store);
    let mut bad = moto.get(&stored.key).unwrap();
    bad[99_999] ^= 0x20;
    moto.put(&stored.key, &bad);
    let (chunks, err) = read_all(&up, &stored, 0, 8 << 10);
    assert!(matches!(err, Some(StoreError::Corrupt { .. })), "{err:?}");
    // The chunk holding the changed byte (the last) was never sent.
    let served = concat(&chunks, 0, 8 << 10);
    assert!(served.len() < 99_999);
    assert_eq!(served, f.data[..served.len()]);

    // A compressed object swapped for other bytes of the same codec.
    let f = Fragment::write(local.path(), "tamper/zst", 0, data(100_000, 4));
    let stored = upload_ok(&up, &f, Codec::Zstd, &store);
    let other = zstd::encode_all(&data(100_000, 5)[..], 3).unwrap();
    moto.put(&stored.key, &other);
    let (_, err) = read_all(&up, &stored, 50_000, 8 << 10);
    assert!(matches!(err, Some(StoreError::Corrupt { .. })), "{err:?}");
}

#[test]
fn locate_presigns_a_get() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "loc/one", 0, data(20_000, 1));
    let stored = upload_ok(&up, &f, Codec::Snappy, &store);
    let url = block_on(up.locate(&stored, Duration::from_secs(600))).unwrap();
    assert!(url.starts_with(&moto.object_url(&stored.key)), "{url}");
    assert!(
        url.contains("X-Amz-Signature=") && url.contains("X-Amz-Expires=600"),
        "{url}"
    );
    let (status, body) = http("GET", &url, b"");
    assert_eq!(status, 200);
    assert_eq!(decompress(Codec::Snappy, &body), f.data);
}

#[test]
fn delete_removes() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "del/one", 0, data(2000, 1));
    let stored = upload_ok(&up, &f, Codec::Gzip, &store);
    assert!(moto.get(&stored.key).is_some());
    block_on(up.delete(&stored)).unwrap();
    assert!(moto.get(&stored.key).is_none());
    assert!(block_on(up.list(&store, "del/one")).unwrap().is_empty());
    block_on(up.delete(&stored)).unwrap();
}

#[test]
fn a_store_that_is_down_is_retryable_and_recovers() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "down/one", 0, data(50_000, 1));
    let port = moto.stop();

    let e = upload(&up, &f, Codec::Zstd, &store).result.unwrap_err();
    assert!(matches!(e, StoreError::Unavailable { .. }), "{e}");
    assert!(e.is_retryable());
    let m = up.metrics();
    assert_eq!(m.upload_failures.load(Ordering::Relaxed), 1);
    assert_eq!(m.upload_retries.load(Ordering::Relaxed), 2);
    let e = block_on(up.list(&store, "down/one")).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    let stale = StoredFragment {
        journal: f.journal.clone(),
        begin: f.begin,
        end: f.end,
        sha1: f.sha1,
        codec: Codec::Zstd,
        store: store.clone(),
        key: f.key(Codec::Zstd),
        size: 1,
        mod_time: std::time::UNIX_EPOCH,
    };
    let (_, err) = read_all(&up, &stale, 0, 1024);
    assert!(
        err.as_ref().is_some_and(StoreError::is_retryable),
        "{err:?}"
    );

    // Back on the same port (moto keeps nothing: the bucket is new).
    let moto = Moto::start_on(port);
    let stored = upload_ok(&up, &f, Codec::Zstd, &store);
    assert_eq!(
        decompress(Codec::Zstd, &moto.get(&stored.key).unwrap()),
        f.data
    );
    assert_eq!(m.uploads.load(Ordering::Relaxed), 1);
}

/// A fragment longer than one part goes up as an S3 multipart upload and
/// reads back whole; one whose bytes do not match its SHA-1 is aborted
/// after its parts were put, and leaves no object.
#[test]
fn long_fragments_go_up_in_parts() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let f = Fragment::write(local.path(), "long/one", 0, data(20 << 20, 3));
    let stored = upload_ok(&up, &f, Codec::None, &store);
    assert_eq!(stored.size, 20 << 20);
    let object = moto.get(&f.key(Codec::None)).expect("object at its key");
    assert_eq!(object, f.data);

    let mut bad = Fragment::write(local.path(), "long/bad", 0, data(20 << 20, 4));
    bad.sha1[19] ^= 1;
    let e = upload(&up, &bad, Codec::None, &store).result.unwrap_err();
    assert!(matches!(e, StoreError::LocalCorrupt { .. }), "{e}");
    assert!(moto.get(&bad.key(Codec::None)).is_none());
}

/// Gzip-offload fragments go up as Gazette puts them: gzip bytes under a
/// name without extension, with `Content-Encoding: gzip` (whole and in
/// parts), and read back; the presigned GET serves the stored gzip bytes.
#[test]
fn gzip_offload_objects_carry_content_encoding() {
    let (moto, up, local) = setup();
    let store = moto.store();
    let codec = Codec::GzipOffload;
    let small = Fragment::write(local.path(), "gzod/small", 0, data(300_000, 8));
    // Random bytes do not compress: more than one part.
    let mut noise = vec![0u8; 10 << 20];
    rand::Rng::fill(&mut rand::thread_rng(), &mut noise[..]);
    let long = Fragment::write(local.path(), "gzod/long", 0, noise);
    for f in [&small, &long] {
        let stored = upload_ok(&up, f, codec, &store);
        assert!(stored.key.ends_with(&hex::encode(f.sha1)), "{}", stored.key);
        let (head, object) = moto.get_with_head(&stored.key);
        assert_eq!(header(&head, "content-encoding"), Some("gzip"), "{head}");
        assert_eq!(stored.size, object.len() as u64);
        assert_eq!(&object[..2], &[0x1f, 0x8b]);
        assert!(decompress(codec, &object) == f.data);
        let (chunks, err) = read_all(&up, &stored, 1000, 1 << 20);
        assert!(err.is_none(), "{err:?}");
        assert!(concat(&chunks, 1000, 1 << 20) == f.data[1000..]);
    }
    // Uploaded again: found, read back as named, and skipped.
    upload_ok(&up, &small, codec, &store);
    assert_eq!(up.metrics().skipped_existing.load(Ordering::Relaxed), 1);
    let stored = upload_ok(&up, &small, codec, &store);
    let url = block_on(up.locate(&stored, Duration::from_secs(600))).unwrap();
    let (status, head, body) = http_exchange("GET", &url, "", b"");
    assert_eq!(status, 200);
    assert_eq!(header(&head, "content-encoding"), Some("gzip"), "{head}");
    assert_eq!(decompress(codec, &body), small.data);
}

/// A bucket written in Gazette's names (every extension and alias, upper
/// case too, gzip-offload objects with `Content-Encoding: gzip`) is listed
/// with each object's codec and read back as the bytes it was made from.
#[test]
fn gazette_named_objects_are_listed_and_read() {
    let (moto, up, _local) = setup();
    let store = moto.store();
    let journal = "gazette/fixture";
    let mut begin = 0u64;
    let mut want = Vec::new();
    let upper = GAZETTE_EXTENSIONS
        .iter()
        .filter(|(e, _)| !e.is_empty())
        .map(|(e, c)| (e.to_uppercase(), *c));
    let spellings = GAZETTE_EXTENSIONS
        .iter()
        .map(|(e, c)| (e.to_string(), *c))
        .chain(upper);
    for (i, (ext, codec)) in spellings.enumerate() {
        let raw = data(30_000 + 999 * i, 60 + i as u64);
        let key = format!("{journal}/{}", gazette_name(begin, &raw, &ext));
        let encoding = if codec == Codec::GzipOffload {
            "Content-Encoding: gzip\r\n"
        } else {
            ""
        };
        moto.put_with(&key, encoding, &compress_as_gazette(codec, &raw));
        begin += raw.len() as u64;
        want.push((key, codec, raw));
    }
    let listed = block_on(up.list(&store, journal)).unwrap();
    assert_eq!(listed.len(), want.len(), "{listed:#?}");
    for (key, codec, raw) in &want {
        let f = listed
            .iter()
            .find(|f| f.key == *key)
            .unwrap_or_else(|| panic!("{key} not listed"));
        assert_eq!(
            (f.codec, f.end - f.begin),
            (*codec, raw.len() as u64),
            "{key}"
        );
        let (chunks, err) = read_all(&up, f, f.begin, 8192);
        assert!(err.is_none(), "{key}: {err:?}");
        assert!(concat(&chunks, f.begin, 8192) == *raw, "{key}");
    }
}
