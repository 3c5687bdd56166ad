//! History in a `file://` store, in-process: sealed fragments are uploaded,
//! a broker started on an empty data directory serves them at their
//! offsets (proxied and as locations), refuses appends until the head is
//! reset, and a clean shutdown uploads the open spool.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{req, start, stat, Conn};
use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::{Codec, JournalSpec};
use rotary_net::status::Status;
use rotary_net::wire::{self, flag, AppendReply, Op};
use std::time::{Duration, Instant};

/// An admin request naming one journal; it must succeed. Its JSON reply.
fn admin<T: serde::de::DeserializeOwned>(c: &mut Conn, op: Op, name: &str) -> T {
    let r = c.admin_ok(op, &wire::encode_name(name), &[]);
    serde_json::from_slice(&r.payload).unwrap()
}

/// Journal `name`, its fragments compressed with `codec` and uploaded to a
/// `file://` store in `root/store`.
fn stored_spec(root: &std::path::Path, name: &str, codec: Codec) -> JournalSpec {
    let mut spec = JournalSpec::new(name);
    spec.fragment.compression_codec = codec;
    spec.fragment.stores = vec![format!("file://{}/", root.join("store").display())];
    spec
}

fn fragments(c: &mut Conn, name: &str) -> Vec<serde_json::Value> {
    admin(c, Op::FRAGMENTS, name)
}

/// A one-shard broker under `root/data` that keeps at most
/// `local_cache_bytes` of uploaded fragments on its disk, and a connection
/// to it.
fn start_with_cache(root: &std::path::Path, local_cache_bytes: u64) -> (Broker, Conn) {
    start_with(
        root,
        local_cache_bytes,
        rotary_engine::OFFSET_JUMP_AGE_DEFAULT,
    )
}

fn start_with(
    root: &std::path::Path,
    local_cache_bytes: u64,
    offset_jump_age: Duration,
) -> (Broker, Conn) {
    let mut cfg = ServeConfig::new(root.join("data"), "127.0.0.1:0".parse().unwrap());
    cfg.cores = 1;
    cfg.disk_reserve_bytes = 0;
    cfg.local_cache_bytes = local_cache_bytes;
    cfg.offset_jump_age = offset_jump_age;
    let broker = Broker::start(cfg).unwrap();
    let c = Conn::new(broker.endpoints[0]);
    (broker, c)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Appends, retrying while the journal's index is still being listed.
fn append(c: &mut Conn, name: &str, bytes: &[u8]) -> AppendReply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, reply) = c.append(&req(name), bytes);
        if status == Status::OK {
            return reply;
        }
        assert!(
            status.is_retryable() && Instant::now() < deadline,
            "append: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every object of `name` in the store at `store_dir` is named by the
/// SHA-1 of its uncompressed bytes, and together they cover `expected`.
fn check_store(store_dir: &std::path::Path, name: &str, expected: &[u8]) {
    let dir = store_dir.join(name);
    let mut covered = 0u64;
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    for n in &names {
        let (begin, end, sha1, ext) = rotary_storage::fragment::parse_fragment_name(n).unwrap();
        assert_eq!(ext, ".zst");
        assert_eq!(begin, covered);
        let raw = zstd::decode_all(&std::fs::read(dir.join(n)).unwrap()[..]).unwrap();
        assert_eq!(raw, expected[begin as usize..end as usize]);
        use sha1::Digest;
        assert_eq!(<[u8; 20]>::from(sha1::Sha1::digest(&raw)), sha1);
        covered = end;
    }
    assert_eq!(
        covered,
        expected.len() as u64,
        "store covers every acknowledged byte"
    );
}

#[test]
fn history_survives_a_wiped_broker() {
    let root = tempfile::tempdir().unwrap();
    let store_dir = root.path().join("store");
    let data = root.path().join("data");
    let name = "hist/journal-a";
    let mut spec = stored_spec(root.path(), name, Codec::Zstd);
    spec.fragment.length = 100_000;
    spec.fragment.refresh_interval = Duration::from_secs(1);

    let mut expected = Vec::new();
    {
        let broker = start(&data, 1);
        let mut c = Conn::new(broker.endpoints[0]);
        c.apply(std::slice::from_ref(&spec));
        for i in 0..40u32 {
            let chunk: Vec<u8> = (0..9000u32)
                .map(|k| (k.wrapping_mul(31) ^ i) as u8)
                .collect();
            let reply = append(&mut c, name, &chunk);
            assert_eq!(reply.begin, expected.len() as u64);
            expected.extend_from_slice(&chunk);
        }
        // Sealed fragments reach the store.
        wait_until("uploads", || {
            let f = fragments(&mut c, name);
            let local: Vec<_> = f
                .iter()
                .filter(|f| f["store"] == "local" && f["open"] == false)
                .collect();
            !local.is_empty() && local.iter().all(|f| f["uploaded"] == true)
        });
        // A clean shutdown seals and uploads the open spool too.
        broker.shutdown();
    }
    check_store(&store_dir, name, &expected);

    // Throw the broker's disk away.
    std::fs::remove_dir_all(&data).unwrap();
    let broker = start(&data, 1);
    let mut c = Conn::new(broker.endpoints[0]);
    c.apply(std::slice::from_ref(&spec));
    // History is readable at once, proxied from the store.
    wait_until("history", || c.read_all(name, 0).0.len() == expected.len());
    let got = c.read_ok(name, 0);
    assert!(got == expected);
    let (got, _) = c.read_all(name, 123_456);
    assert!(got[..] == expected[123_456..]);
    // Direct read: the broker answers with the fragment's location.
    c.send_read(name, 5, flag::DO_NOT_PROXY, 31);
    let frag = c.recv();
    assert_eq!(frag.op, Op::READ_FRAGMENT);
    let meta: wire::ReadFragment = wire::decode_fixed(&frag.meta, "fragment").unwrap();
    assert_eq!((meta.begin.get(), meta.offset.get()), (0, 5));
    let location = String::from_utf8(frag.payload.clone()).unwrap();
    let path = location.strip_prefix("file://").unwrap();
    let raw = zstd::decode_all(&std::fs::read(path).unwrap()[..]).unwrap();
    assert_eq!(raw, expected[..meta.end.get() as usize]);
    let done = c.recv();
    assert_eq!((done.op, done.known_status()), (Op::READ_DONE, Status::OK));
    assert_eq!(
        u64::from_le_bytes(done.meta[..8].try_into().unwrap()),
        meta.end.get()
    );
    // Appends refuse until the head is reset.
    let (status, reply) = c.append(&req(name), b"too early");
    assert_eq!(status, Status::INDEX_HAS_GREATER_OFFSET);
    assert_eq!(reply.write_head, 0);
    let v: serde_json::Value = admin(&mut c, Op::RESET_HEAD, name);
    assert_eq!(v["write_head"], expected.len() as u64);
    let reply = append(&mut c, name, b"after reset");
    assert_eq!(reply.begin, expected.len() as u64);
    expected.extend_from_slice(b"after reset");
    let (got, _) = c.read_all(name, 0);
    assert!(got == expected);
    broker.shutdown();
}

/// A blocking read at an offset that no file holds any more (its fragment
/// left the broker's disk once uploaded, then left the store) waits as a
/// read at the head does: the shard goes on serving everything else, and
/// the read resumes where bytes exist again (the gap is permanent at once
/// here: `offset_jump_age` zero).
#[test]
fn a_read_in_missing_history_waits_without_stalling_the_shard() {
    let root = tempfile::tempdir().unwrap();
    // Uploaded fragments leave the broker's disk at once.
    let (broker, mut c) = start_with(root.path(), 0, Duration::ZERO);
    let (a, b) = ("hist/missing-a", "hist/missing-b");
    let mut spec = stored_spec(root.path(), a, Codec::None);
    spec.fragment.refresh_interval = Duration::from_secs(1);
    c.apply(&[spec, JournalSpec::new(b)]);

    let history = vec![b'h'; 5000];
    append(&mut c, a, &history);
    let _: serde_json::Value = admin(&mut c, Op::SEAL, a);
    wait_until("the upload, and the local copy gone", || {
        let f = fragments(&mut c, a);
        !f.is_empty() && f.iter().all(|f| f["store"] != "local")
    });
    // The store loses the object; the next listing drops it from the index.
    std::fs::remove_dir_all(root.path().join("store").join(a)).unwrap();
    wait_until("the listing without it", || fragments(&mut c, a).is_empty());

    let mut reader = Conn::new(broker.endpoints[0]);
    reader.send_read(a, 0, flag::BLOCK, 41);
    // Give the read time to reach its wait; nothing below depends on it.
    std::thread::sleep(Duration::from_millis(200));

    // The shard still answers: another journal's append, then this one's.
    let reply = append(&mut c, b, b"elsewhere");
    assert_eq!(reply.begin, 0);
    let reply = append(&mut c, a, b"after the gap");
    assert_eq!(reply.begin, history.len() as u64);
    // The read jumps over the missing history to the bytes that exist.
    let data = reader.recv();
    assert_eq!((data.op, data.id), (Op::READ_DATA, 41));
    let at = u64::from_le_bytes(data.meta[..8].try_into().unwrap());
    assert_eq!(at, history.len() as u64);
    assert_eq!(data.payload, b"after the gap");
    broker.shutdown();
}

/// Once the local copies of uploaded fragments exceed the cache budget, the
/// oldest sealed go first and the newest stay on the broker's disk.
#[test]
fn the_local_cache_drops_the_oldest_uploaded_fragments_first() {
    let root = tempfile::tempdir().unwrap();
    // Room for two of the three fragments below.
    let (broker, mut c) = start_with_cache(root.path(), 2000);
    let name = "hist/cache";
    let spec = stored_spec(root.path(), name, Codec::None);
    c.apply(&[spec]);

    let local = |c: &mut Conn| -> Vec<(u64, u64, bool)> {
        fragments(c, name)
            .iter()
            .filter(|f| f["store"] == "local")
            .map(|f| {
                (
                    f["begin"].as_u64().unwrap(),
                    f["end"].as_u64().unwrap(),
                    f["uploaded"] == true,
                )
            })
            .collect()
    };
    for i in 0..3u64 {
        append(&mut c, name, &[b'a' + i as u8; 1000]);
        let _: serde_json::Value = admin(&mut c, Op::SEAL, name);
        wait_until("the upload", || {
            local(&mut c)
                .iter()
                .any(|&(b, _, uploaded)| b == i * 1000 && uploaded)
        });
    }
    assert_eq!(
        local(&mut c),
        vec![(1000, 2000, true), (2000, 3000, true)],
        "the first fragment sealed left the disk"
    );
    // Its bytes still read, from the store.
    let got = c.read_ok(name, 0);
    assert_eq!(got.len(), 3000);
    assert!(got[..1000].iter().all(|b| *b == b'a'));
    broker.shutdown();
}

/// A broker keeping `local_cache_bytes` of uploaded fragments, and the
/// journal `name` with 1 MiB uncompressed fragments in a `file://` store
/// under `root`: its evicted fragments' files become spare spools.
fn start_with_recycling(
    root: &std::path::Path,
    local_cache_bytes: u64,
    name: &str,
) -> (Broker, Conn) {
    let (broker, mut c) = start_with_cache(root, local_cache_bytes);
    let mut spec = stored_spec(root, name, Codec::None);
    spec.fragment.length = 1 << 20;
    c.apply(&[spec]);
    (broker, c)
}

/// Fragments that are in the store and leave the local cache give their
/// files to the next spools, which overwrite them in place. Nothing of a
/// file's old bytes surfaces: every byte reads back, each local fragment
/// file holds exactly its own bytes, and so it stays after a restart.
#[test]
fn evicted_fragments_files_become_new_spools_without_their_old_bytes() {
    use rand::{Rng, SeedableRng};
    use sha1::Digest;
    let root = tempfile::tempdir().unwrap();
    let name = "hist/recycled";
    // Room for about two fragments.
    let (broker, mut c) = start_with_recycling(root.path(), 3 << 20, name);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut expected = Vec::new();
    // Appends go on until three spools were begun in spare files (each
    // append of a third of a fragment; uploads and evictions run behind).
    let deadline = Instant::now() + Duration::from_secs(30);
    while stat(&mut c, "spools_recycled") < 3 {
        assert!(Instant::now() < deadline, "no spool was recycled");
        let len = rng.gen_range(300_000..400_000);
        let bytes: Vec<u8> = (0..len).map(|_| rng.r#gen()).collect();
        let r = append(&mut c, name, &bytes);
        assert_eq!(r.begin, expected.len() as u64);
        expected.extend_from_slice(&bytes);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(stat(&mut c, "spares_kept") >= 3);
    // One more fragment's worth, sealed: its file was a spare too.
    let tail: Vec<u8> = (0..1_200_000).map(|_| rng.r#gen()).collect();
    append(&mut c, name, &tail);
    expected.extend_from_slice(&tail);
    let _: serde_json::Value = admin(&mut c, Op::SEAL, name);

    let check_files = |expected: &[u8]| {
        let dir = root
            .path()
            .join("data/shard-0/journals")
            .join(name)
            .join("@");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_str().unwrap().to_string();
            let Some(stem) = file.strip_suffix(".raw") else {
                continue;
            };
            let parts: Vec<&str> = stem.split('-').collect();
            let begin = u64::from_str_radix(parts[0], 16).unwrap() as usize;
            let end = u64::from_str_radix(parts[1], 16).unwrap() as usize;
            let on_disk = std::fs::read(&path).unwrap();
            assert!(on_disk == expected[begin..end], "{file} holds other bytes");
            assert_eq!(
                hex::encode(sha1::Sha1::digest(&on_disk)),
                parts[2],
                "{file}"
            );
            seen += 1;
        }
        assert!(seen > 0, "no local fragment in {}", dir.display());
    };
    check_files(&expected);
    let got = c.read_ok(name, 0);
    assert!(got == expected, "read back differs");
    broker.shutdown();

    let spares = root.path().join("data/shard-0/spares");
    assert!(std::fs::read_dir(&spares).unwrap().count() <= rotary_engine::spares::SPARES_MAX);
    let (broker, mut c) = start_with_cache(root.path(), 3 << 20);
    let more: Vec<u8> = (0..700_000).map(|_| rng.r#gen()).collect();
    let r = append(&mut c, name, &more);
    assert_eq!(r.begin, expected.len() as u64);
    expected.extend_from_slice(&more);
    let got = c.read_ok(name, 0);
    assert!(got == expected, "read back after a restart differs");
    check_files(&expected);
    broker.shutdown();
}

/// Readers that read the whole journal again and again while appends roll
/// fragments, uploads finish and evictions hand their files to new spools:
/// every byte read is the byte appended at that offset.
#[test]
fn reads_racing_evictions_and_recycled_spools_get_only_their_own_bytes() {
    use rand::{Rng, SeedableRng};
    use std::sync::{Arc, Mutex};
    let root = tempfile::tempdir().unwrap();
    let name = "hist/recycled-while-read";
    let (broker, mut c) = start_with_recycling(root.path(), 2 << 20, name);
    let endpoint = broker.endpoints[0];

    let expected = Arc::new(Mutex::new(Vec::<u8>::new()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let expected = expected.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut c = Conn::new(endpoint);
                let mut reads = 0;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    let (got, status) = c.read_all(name, 0);
                    if status != Status::OK {
                        // The first listing may not have finished yet.
                        assert!(status.is_retryable(), "read: {status}");
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    let want = expected.lock().unwrap();
                    assert!(got.len() <= want.len(), "read past what was appended");
                    if let Some(at) = (0..got.len()).find(|&i| got[i] != want[i]) {
                        panic!("byte {at} of {} read differs", got.len());
                    }
                    reads += 1;
                }
                reads
            })
        })
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let deadline = Instant::now() + Duration::from_secs(40);
    while stat(&mut c, "spools_recycled") < 6 {
        assert!(Instant::now() < deadline, "too few spools were recycled");
        let len = rng.gen_range(100_000..300_000);
        let bytes: Vec<u8> = (0..len).map(|_| rng.r#gen()).collect();
        // Recorded before it is appended: a reader may see it at once.
        let at = {
            let mut want = expected.lock().unwrap();
            want.extend_from_slice(&bytes);
            want.len() - bytes.len()
        };
        let r = append(&mut c, name, &bytes);
        assert_eq!(r.begin, at as u64);
        std::thread::sleep(Duration::from_millis(10));
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    for r in readers {
        let reads = r.join().expect("a reader failed");
        assert!(reads > 0, "a reader never read");
    }
    let got = c.read_ok(name, 0);
    assert!(got == *expected.lock().unwrap(), "read back differs");
    broker.shutdown();
}
