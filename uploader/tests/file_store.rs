//! The uploader against a `file://` store in a temporary directory.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_proto::spec::Codec;
use rotary_uploader::{StoreError, Uploader};
use std::sync::atomic::Ordering;
use std::time::Duration;

struct Setup {
    up: Uploader,
    /// Local fragments.
    local: tempfile::TempDir,
    /// The store's directory.
    dir: tempfile::TempDir,
    store: String,
}

fn setup() -> Setup {
    let local = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}/store/", dir.path().display());
    Setup {
        up: Uploader::start(2, 8),
        local,
        dir,
        store,
    }
}

impl Setup {
    fn object(&self, key: &str) -> std::path::PathBuf {
        self.dir.path().join("store").join(key)
    }
}

#[test]
fn every_codec_round_trips() {
    let s = setup();
    let mut raw_total = 0;
    let mut stored_total = 0;
    for (i, codec) in CODECS.into_iter().enumerate() {
        let f = Fragment::write(
            s.local.path(),
            "orders/part-000",
            1000 * i as u64,
            data(300_000, i as u64),
        );
        let stored = upload_ok(&s.up, &f, codec, &s.store);
        // The object sits at the exact key, and the codec's own library
        // decodes it to bytes of the named SHA-1.
        let object = std::fs::read(s.object(&f.key(codec))).unwrap();
        assert_eq!(stored.size, object.len() as u64);
        assert_eq!(decompress(codec, &object), f.data, "{codec:?}");
        match codec {
            Codec::None => {}
            Codec::Snappy => assert!(object.len() < f.data.len(), "{codec:?} compresses"),
            _ => assert!(object.len() < f.data.len() / 2, "{codec:?} compresses"),
        }
        raw_total += f.data.len() as u64;
        stored_total += object.len() as u64;
    }
    let m = s.up.metrics();
    assert_eq!(m.uploads.load(Ordering::Relaxed), CODECS.len() as u64);
    assert_eq!(m.upload_bytes.load(Ordering::Relaxed), raw_total);
    assert_eq!(m.upload_stored_bytes.load(Ordering::Relaxed), stored_total);
    assert!(m.upload_micros.load(Ordering::Relaxed) > 0);
    assert_eq!(m.upload_failures.load(Ordering::Relaxed), 0);
    assert!(s.up.wait_idle(WAIT));
    assert_eq!(m.queued.load(Ordering::Relaxed), 0);
    assert_eq!(m.in_flight.load(Ordering::Relaxed), 0);
}

#[test]
fn reupload_is_skipped() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "a/journal", 0, data(10_000, 1));
    let first = upload(&s.up, &f, Codec::Zstd, &s.store);
    let second = upload(&s.up, &f, Codec::Zstd, &s.store);
    // Only the upload that wrote the object read the local file.
    assert!(first.local_checked && !second.local_checked);
    let first = stored_as_uploaded(first, &f, Codec::Zstd, &s.store);
    let second = stored_as_uploaded(second, &f, Codec::Zstd, &s.store);
    assert_eq!(first.size, second.size);
    let m = s.up.metrics();
    assert_eq!(m.uploads.load(Ordering::Relaxed), 1);
    assert_eq!(m.skipped_existing.load(Ordering::Relaxed), 1);
}

#[test]
fn listing_is_exactly_the_journals_fragments() {
    let s = setup();
    let ab0 = Fragment::write(s.local.path(), "jr/a/b", 0, data(5000, 1));
    let ab1 = Fragment::write(s.local.path(), "jr/a/b", 5000, data(7000, 2));
    let abc = Fragment::write(s.local.path(), "jr/a/b/c", 0, data(3000, 3));
    let abx = Fragment::write(s.local.path(), "jr/a/bc", 0, data(3000, 4));
    let want0 = upload_ok(&s.up, &ab0, Codec::Gzip, &s.store);
    let want1 = upload_ok(&s.up, &ab1, Codec::Snappy, &s.store);
    let child = upload_ok(&s.up, &abc, Codec::Zstd, &s.store);
    upload_ok(&s.up, &abx, Codec::None, &s.store);

    // A fragment under a Gazette postfix directory, and things that are
    // not a/b's fragments: junk, a child journal's directory without '=',
    // and anything deeper than one postfix.
    let postfixed = Fragment::write(s.local.path(), "jr/a/b", 12_000, data(100, 5));
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
        std::fs::create_dir_all(s.object(rel)).unwrap();
        std::fs::write(s.object(&format!("{rel}/{name}")), &postfixed.data).unwrap();
    }
    std::fs::write(s.object("jr/a/b/README"), b"not a fragment").unwrap();
    std::fs::write(s.object(&format!("jr/a/b/{name}.tmp")), b"not a fragment").unwrap();

    let listed = block_on(s.up.list(&s.store, "jr/a/b")).unwrap();
    let keys: Vec<&str> = listed.iter().map(|f| f.key.as_str()).collect();
    let postfix_key = format!("jr/a/b/pivot=1/{name}");
    assert_eq!(
        keys,
        vec![want0.key.as_str(), want1.key.as_str(), postfix_key.as_str()]
    );
    let strip = |f: &rotary_uploader::StoredFragment| {
        let mut f = f.clone();
        f.mod_time = std::time::UNIX_EPOCH;
        f
    };
    assert_eq!(strip(&listed[0]), strip(&want0));
    assert_eq!(strip(&listed[1]), strip(&want1));
    assert_eq!(
        (listed[2].begin, listed[2].end, listed[2].sha1),
        (12_000, 12_100, postfixed.sha1)
    );
    assert_eq!(listed[2].size, 100);

    // The child journal sees its own, including its postfix directory.
    let listed = block_on(s.up.list(&s.store, "jr/a/b/c")).unwrap();
    let keys: Vec<&str> = listed.iter().map(|f| f.key.as_str()).collect();
    let child_postfix = format!("jr/a/b/c/pivot=2/{name}");
    assert_eq!(keys, vec![child.key.as_str(), child_postfix.as_str()]);

    // A journal never written lists empty; a bad name is an error.
    assert!(block_on(s.up.list(&s.store, "never/written"))
        .unwrap()
        .is_empty());
    let e = block_on(s.up.list(&s.store, "jr/../b")).unwrap_err();
    assert!(matches!(e, StoreError::BadJournal { .. }), "{e}");
}

/// What a broker killed mid-upload leaves in a file store (`<name>#<n>`)
/// is removed by a later listing once it is an hour old; other files, and
/// staging files that may still be written, stay.
#[test]
fn listing_removes_stale_staging_files() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "st/a", 0, data(4000, 1));
    let stored = upload_ok(&s.up, &f, Codec::None, &s.store);
    std::fs::create_dir_all(s.object("st/a/pivot=1")).unwrap();
    let aged = |rel: &str, hours: u64| {
        let path = s.object(rel);
        std::fs::write(&path, b"half an upload").unwrap();
        let when = std::time::SystemTime::now() - Duration::from_secs(hours * 3600);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
        path
    };
    let stale = aged(&format!("{}#1", stored.key), 2);
    let stale_postfixed = aged("st/a/pivot=1/0000000000000000-0000000000000010-x.raw#12", 2);
    let fresh = aged(&format!("{}#2", stored.key), 0);
    let not_staging = aged("st/a/notes#v1", 2);
    let not_staging_empty = aged("st/a/notes#", 2);

    let listed = block_on(s.up.list(&s.store, "st/a")).unwrap();
    let keys: Vec<&str> = listed.iter().map(|f| f.key.as_str()).collect();
    assert_eq!(keys, vec![stored.key.as_str()]);
    assert!(!stale.exists() && !stale_postfixed.exists());
    assert!(fresh.exists() && not_staging.exists() && not_staging_empty.exists());
    assert!(s.object(&stored.key).exists());
    assert_eq!(
        rotary_uploader::remove_stale_staging(&s.object("st/a"), Duration::ZERO),
        1,
        "only the fresh staging file is left to remove"
    );
    assert!(!fresh.exists());
}

#[test]
fn read_streams_exact_bytes_from_the_middle() {
    let s = setup();
    for (i, codec) in CODECS.into_iter().enumerate() {
        let begin = 1 << 20;
        let f = Fragment::write(
            s.local.path(),
            &format!("reads/{i:03}"),
            begin,
            data(700_000, 10 + i as u64),
        );
        let stored = upload_ok(&s.up, &f, codec, &s.store);
        for (from, chunk_max) in [
            (begin + 123_457, 64 << 10),
            (begin, 1 << 20),
            (f.end - 1, 7),
        ] {
            let (chunks, err) = read_all(&s.up, &stored, from, chunk_max);
            assert!(err.is_none(), "{codec:?}: {err:?}");
            let got = concat(&chunks, from, chunk_max);
            assert_eq!(
                got,
                f.data[(from - begin) as usize..],
                "{codec:?} from {from}"
            );
        }
        // The end is an empty stream; outside the fragment is an error.
        let (chunks, err) = read_all(&s.up, &stored, f.end, 100);
        assert!(chunks.is_empty() && err.is_none());
        let (_, err) = read_all(&s.up, &stored, f.end + 1, 100);
        assert!(matches!(err, Some(StoreError::BadOffset { .. })), "{err:?}");
        let (_, err) = read_all(&s.up, &stored, begin - 1, 100);
        assert!(matches!(err, Some(StoreError::BadOffset { .. })), "{err:?}");
    }
}

#[test]
fn read_spans_several_ranged_gets() {
    let s = setup();
    // Larger than one ranged GET (8 MiB), stored uncompressed.
    let f = Fragment::write(s.local.path(), "big/one", 0, data(9 << 20, 7));
    let stored = upload_ok(&s.up, &f, Codec::None, &s.store);
    let from = (8 << 20) - 1000;
    let (chunks, err) = read_all(&s.up, &stored, from, 256 << 10);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(concat(&chunks, from, 256 << 10), f.data[from as usize..]);
}

#[test]
fn tampered_objects_are_never_served_whole() {
    let s = setup();
    for (i, codec) in CODECS.into_iter().enumerate() {
        let f = Fragment::write(
            s.local.path(),
            &format!("tamper/{i:03}"),
            0,
            data(200_000, 20 + i as u64),
        );
        let stored = upload_ok(&s.up, &f, codec, &s.store);
        let object = s.object(&stored.key);
        let good = std::fs::read(&object).unwrap();
        // Re-encode the tampered bytes properly, so only the SHA-1 can tell.
        let mut bad_data = f.data.clone();
        bad_data[150_000] ^= 1;
        let bad = {
            let dir = tempfile::tempdir().unwrap();
            let up = Uploader::start(1, 1);
            let store = format!("file://{}/", dir.path().display());
            let bad_f = Fragment::write(dir.path(), "x/tampered", 0, bad_data.clone());
            let bad_stored = upload_ok(&up, &bad_f, codec, &store);
            std::fs::read(dir.path().join(bad_stored.key)).unwrap()
        };
        assert_ne!(bad, good);
        std::fs::write(&object, &bad).unwrap();
        let (chunks, err) = read_all(&s.up, &stored, 0, 16 << 10);
        assert!(
            matches!(err, Some(StoreError::Corrupt { .. })),
            "{codec:?}: {err:?}"
        );
        assert!(!err.unwrap().is_retryable());
        // What came before the error is a strict prefix: the last chunk was held back.
        let served = concat(&chunks, 0, 16 << 10);
        assert!(served.len() < bad_data.len());
        assert_eq!(served, bad_data[..served.len()]);

        // Truncated and garbage objects are refused too.
        std::fs::write(&object, &good[..good.len() - 1]).unwrap();
        let (_, err) = read_all(&s.up, &stored, 0, 16 << 10);
        assert!(
            matches!(err, Some(StoreError::Corrupt { .. })),
            "{codec:?}: {err:?}"
        );
        std::fs::write(&object, b"garbage").unwrap();
        let (_, err) = read_all(&s.up, &stored, 0, 16 << 10);
        assert!(
            matches!(err, Some(StoreError::Corrupt { .. })),
            "{codec:?}: {err:?}"
        );

        // The true bytes read again.
        std::fs::write(&object, &good).unwrap();
        let (chunks, err) = read_all(&s.up, &stored, 0, 16 << 10);
        assert!(err.is_none());
        assert_eq!(concat(&chunks, 0, 16 << 10), f.data);
    }
}

/// A store written in Gazette's names: every extension and alias, upper
/// case too, gzip-offload with no extension and with `.gzod`, one under a
/// postfix directory. Each object is listed with its codec and key as
/// written, and reads back as the bytes it was made from.
#[test]
fn gazette_named_objects_are_listed_and_read() {
    let s = setup();
    let journal = "gazette/fixture";
    let mut spellings: Vec<(String, Codec)> = GAZETTE_EXTENSIONS
        .iter()
        .map(|&(ext, codec)| (ext.to_string(), codec))
        .collect();
    for (ext, codec) in GAZETTE_EXTENSIONS.iter().filter(|(e, _)| !e.is_empty()) {
        spellings.push((ext.to_uppercase(), *codec));
    }
    let mut begin = 0u64;
    let mut want = Vec::new();
    for (i, (ext, codec)) in spellings.iter().enumerate() {
        let raw = data(20_000 + 1000 * i, 40 + i as u64);
        let postfix = if i == 3 { "pivot=1/" } else { "" };
        let key = format!("{journal}/{postfix}{}", gazette_name(begin, &raw, ext));
        let path = s.object(&key);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, compress_as_gazette(*codec, &raw)).unwrap();
        want.push((key, *codec, begin, raw));
        begin += want.last().unwrap().3.len() as u64;
    }
    let listed = block_on(s.up.list(&s.store, journal)).unwrap();
    assert_eq!(listed.len(), want.len(), "{listed:#?}");
    for (key, codec, begin, raw) in &want {
        let f = listed
            .iter()
            .find(|f| f.key == *key)
            .unwrap_or_else(|| panic!("{key} not listed"));
        assert_eq!(
            (f.codec, f.begin, f.end),
            (*codec, *begin, begin + raw.len() as u64),
            "{key}"
        );
        let from = begin + 777;
        let (chunks, err) = read_all(&s.up, f, from, 4096);
        assert!(err.is_none(), "{key}: {err:?}");
        assert_eq!(concat(&chunks, from, 4096), raw[777..], "{key}");
    }
}

#[test]
fn locate_gives_the_objects_path() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "loc/a=b", 0, data(4000, 1));
    let stored = upload_ok(&s.up, &f, Codec::Gzip, &s.store);
    let url = block_on(s.up.locate(&stored, Duration::from_secs(60))).unwrap();
    let path = s.object(&stored.key);
    assert_eq!(url, format!("file://{}", path.display()));
    let bytes = std::fs::read(url.strip_prefix("file://").unwrap()).unwrap();
    assert_eq!(decompress(Codec::Gzip, &bytes), f.data);
}

#[test]
fn delete_removes() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "del/one", 0, data(4000, 1));
    let stored = upload_ok(&s.up, &f, Codec::Snappy, &s.store);
    assert_eq!(block_on(s.up.list(&s.store, "del/one")).unwrap().len(), 1);
    block_on(s.up.delete(&stored)).unwrap();
    assert!(!s.object(&stored.key).exists());
    assert!(block_on(s.up.list(&s.store, "del/one")).unwrap().is_empty());
    // Already gone is fine.
    block_on(s.up.delete(&stored)).unwrap();
    let (_, err) = read_all(&s.up, &stored, 0, 1024);
    assert!(matches!(err, Some(StoreError::NotFound { .. })), "{err:?}");
}

#[test]
fn bad_local_fragments_are_not_retryable() {
    let s = setup();
    let mut f = Fragment::write(s.local.path(), "bad/local", 0, data(4000, 1));
    // Bytes that don't match the job's SHA-1.
    f.sha1[0] ^= 1;
    let e = upload(&s.up, &f, Codec::Zstd, &s.store).result.unwrap_err();
    assert!(matches!(e, StoreError::LocalCorrupt { .. }), "{e}");
    assert!(!e.is_retryable());
    f.sha1[0] ^= 1;
    // A length that doesn't match.
    f.end += 1;
    let e = upload(&s.up, &f, Codec::Zstd, &s.store).result.unwrap_err();
    assert!(matches!(e, StoreError::LocalCorrupt { .. }), "{e}");
    f.end -= 1;
    // A missing file.
    std::fs::remove_file(&f.path).unwrap();
    let e = upload(&s.up, &f, Codec::Zstd, &s.store).result.unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::LocalIo {
                kind: std::io::ErrorKind::NotFound,
                ..
            }
        ),
        "{e}"
    );
    assert!(!e.is_retryable());
    // Nothing reached the store.
    assert!(block_on(s.up.list(&s.store, "bad/local"))
        .unwrap()
        .is_empty());
    assert_eq!(s.up.metrics().upload_failures.load(Ordering::Relaxed), 3);
    assert_eq!(s.up.metrics().upload_retries.load(Ordering::Relaxed), 0);
}

#[test]
fn bad_store_urls_are_not_retryable() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "bad/store", 0, data(100, 1));
    for url in ["file://relative/", "s3://bucket", "gs://bucket/"] {
        let e = upload(&s.up, &f, Codec::None, url).result.unwrap_err();
        assert!(matches!(e, StoreError::BadUrl { .. }), "{e}");
        assert!(!e.is_retryable());
        let e = block_on(s.up.list(url, "bad/store")).unwrap_err();
        assert!(matches!(e, StoreError::BadUrl { .. }), "{e}");
    }
}

#[test]
fn a_full_queue_gives_jobs_back() {
    let local = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}/", dir.path().display());
    let up = Uploader::start(1, 1);
    let (tx, rx) = async_channel::unbounded();
    let fragments: Vec<Fragment> = (0..32)
        .map(|i| Fragment::write(local.path(), "queue/full", i * 300_000, data(300_000, i)))
        .collect();
    let mut accepted = 0;
    let mut refused = 0;
    for f in &fragments {
        match up.try_upload(f.job(Codec::Gzip, &store, tx.clone())) {
            Ok(()) => accepted += 1,
            Err(job) => {
                assert_eq!(job.begin, f.begin);
                refused += 1;
            }
        }
    }
    // One thread, one queue slot: most of a burst is refused at once.
    assert!(refused > 0, "accepted {accepted}");
    for _ in 0..accepted {
        recv(&rx).result.unwrap();
    }
    assert!(up.wait_idle(WAIT));
    assert_eq!(up.metrics().uploads.load(Ordering::Relaxed), accepted);
}

#[test]
fn requests_fail_cleanly_once_the_pool_is_gone() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "gone/one", 0, data(100, 1));
    let stored = upload_ok(&s.up, &f, Codec::None, &s.store);
    let rx = {
        let up = s.up.clone();
        drop(s.up);
        let rx = up.read(&stored, 0, 10);
        drop(up);
        rx
    };
    // The stream ends, and what it served is a prefix of the fragment.
    let served = block_on(async move {
        let mut bytes = Vec::new();
        while let Ok(item) = rx.recv().await {
            match item {
                Ok(c) => bytes.extend_from_slice(&c.bytes),
                Err(e) => {
                    assert!(matches!(e, StoreError::Stopped), "{e}");
                    break;
                }
            }
        }
        bytes
    });
    assert_eq!(served, f.data[..served.len()]);
}

/// A fragment longer than one part goes up as a multipart upload, through
/// bounded memory, and reads back whole; one whose bytes do not match its
/// SHA-1 is caught after its parts were put, and leaves no object.
#[test]
fn long_fragments_go_up_in_parts() {
    let s = setup();
    let f = Fragment::write(s.local.path(), "long/one", 0, data(20 << 20, 3));
    let stored = upload_ok(&s.up, &f, Codec::None, &s.store);
    let object = std::fs::read(s.object(&f.key(Codec::None))).unwrap();
    assert_eq!(stored.size, 20 << 20);
    assert_eq!(object, f.data);

    let mut bad = Fragment::write(s.local.path(), "long/bad", 0, data(20 << 20, 4));
    bad.sha1[19] ^= 1;
    let e = upload(&s.up, &bad, Codec::None, &s.store)
        .result
        .unwrap_err();
    assert!(matches!(e, StoreError::LocalCorrupt { .. }), "{e}");
    assert!(!s.object(&bad.key(Codec::None)).exists());
    assert!(block_on(s.up.list(&s.store, "long/bad"))
        .unwrap()
        .is_empty());
}
