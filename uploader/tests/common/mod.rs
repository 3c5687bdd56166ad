//! Helpers shared by the uploader's test binaries. Each binary uses a
//! different subset, hence `dead_code` is allowed here.
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rotary_proto::spec::Codec;
use rotary_uploader::{HistoryChunk, StoreError, StoredFragment, UploadDone, UploadJob, Uploader};
use sha1::{Digest, Sha1};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const CODECS: [Codec; 5] = Codec::ALL;

/// Gazette's object-name extensions (its `CompressionCodecFromExtension`,
/// which lower-cases the extension first) and the codec of each, written
/// out here rather than taken from rotary's table. Gzip-offload objects
/// have no extension, or `.gzod`.
pub const GAZETTE_EXTENSIONS: [(&str, Codec); 9] = [
    (".raw", Codec::None),
    (".gz", Codec::Gzip),
    (".gzip", Codec::Gzip),
    (".zst", Codec::Zstd),
    (".zstandard", Codec::Zstd),
    (".sz", Codec::Snappy),
    (".snappy", Codec::Snappy),
    ("", Codec::GzipOffload),
    (".gzod", Codec::GzipOffload),
];

/// Longest a test waits for one upload or read.
pub const WAIT: Duration = Duration::from_secs(60);

/// Runs a future on a compio executor, as a shard would: no tokio context.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    compio::runtime::Runtime::new()
        .expect("compio runtime")
        .block_on(f)
}

/// Journal-like bytes: compressible, but not trivially.
pub fn data(len: usize, seed: u64) -> Vec<u8> {
    const WORDS: [&str; 8] = [
        "order", "ship", "pay", "refund", "sku", "cart", "user", "\n",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(len + 32);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
        out.extend_from_slice(format!(" {} ", rng.gen::<u16>()).as_bytes());
    }
    out.truncate(len);
    out
}

/// A sealed local fragment.
pub struct Fragment {
    pub journal: String,
    pub begin: u64,
    pub end: u64,
    pub sha1: [u8; 20],
    pub data: Vec<u8>,
    pub path: PathBuf,
}

impl Fragment {
    pub fn write(dir: &Path, journal: &str, begin: u64, data: Vec<u8>) -> Fragment {
        let end = begin + data.len() as u64;
        let sha1: [u8; 20] = Sha1::digest(&data).into();
        let path = dir.join(format!(
            "{}-{begin:016x}-{end:016x}.raw",
            journal.replace('/', "_")
        ));
        std::fs::write(&path, &data).unwrap();
        Fragment {
            journal: journal.to_string(),
            begin,
            end,
            sha1,
            data,
            path,
        }
    }

    pub fn job(
        &self,
        codec: Codec,
        store: &str,
        done: async_channel::Sender<UploadDone>,
    ) -> UploadJob {
        UploadJob {
            journal: self.journal.clone(),
            begin: self.begin,
            end: self.end,
            sha1: self.sha1,
            path: self.path.clone(),
            codec,
            store: store.to_string(),
            done,
        }
    }

    /// The key rotary writes: `<journal>/<begin>-<end>-<sha1><ext>`.
    pub fn key(&self, codec: Codec) -> String {
        format!(
            "{}/{:016x}-{:016x}-{}{}",
            self.journal,
            self.begin,
            self.end,
            hex::encode(self.sha1),
            codec.extension()
        )
    }
}

/// Waits for one message, failing the test after [`WAIT`].
pub fn recv<T>(rx: &async_channel::Receiver<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        match rx.try_recv() {
            Ok(t) => return t,
            Err(async_channel::TryRecvError::Closed) => panic!("channel closed"),
            Err(async_channel::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "nothing arrived in {WAIT:?}");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Uploads one fragment and waits for its outcome.
pub fn upload(up: &Uploader, f: &Fragment, codec: Codec, store: &str) -> UploadDone {
    let (tx, rx) = async_channel::unbounded();
    let mut job = f.job(codec, store, tx);
    let deadline = Instant::now() + WAIT;
    while let Err(back) = up.try_upload(job) {
        assert!(Instant::now() < deadline, "upload queue stayed full");
        job = back;
        std::thread::sleep(Duration::from_millis(5));
    }
    let done = recv(&rx);
    assert_eq!(
        (done.journal.as_str(), done.begin, done.end),
        (f.journal.as_str(), f.begin, f.end)
    );
    done
}

/// Uploads and unwraps, checking the reported fragment.
pub fn upload_ok(up: &Uploader, f: &Fragment, codec: Codec, store: &str) -> StoredFragment {
    stored_as_uploaded(upload(up, f, codec, store), f, codec, store)
}

/// The fragment an upload reported, checked against what was uploaded.
pub fn stored_as_uploaded(
    done: UploadDone,
    f: &Fragment,
    codec: Codec,
    store: &str,
) -> StoredFragment {
    let stored = done.result.expect("upload");
    assert_eq!(stored.key, f.key(codec));
    assert_eq!(
        (stored.begin, stored.end, stored.sha1, stored.codec),
        (f.begin, f.end, f.sha1, codec)
    );
    assert_eq!(stored.store, store);
    stored
}

/// Decompresses with each format's standard library, independent of the
/// uploader's own code.
pub fn decompress(codec: Codec, packed: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match codec {
        Codec::None => out.extend_from_slice(packed),
        Codec::Gzip | Codec::GzipOffload => {
            flate2::read::GzDecoder::new(packed)
                .read_to_end(&mut out)
                .unwrap();
        }
        Codec::Zstd => out = zstd::decode_all(packed).unwrap(),
        Codec::Snappy => {
            snap::read::FrameDecoder::new(packed)
                .read_to_end(&mut out)
                .unwrap();
        }
    }
    out
}

/// Compresses as a Gazette writer does, with each format's standard
/// library: one gzip member (gzip-offload too), a zstd frame, snappy's
/// framing format.
pub fn compress_as_gazette(codec: Codec, raw: &[u8]) -> Vec<u8> {
    match codec {
        Codec::None => raw.to_vec(),
        Codec::Gzip | Codec::GzipOffload => {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            enc.write_all(raw).unwrap();
            enc.finish().unwrap()
        }
        Codec::Zstd => zstd::encode_all(raw, 3).unwrap(),
        Codec::Snappy => {
            let mut enc = snap::write::FrameEncoder::new(Vec::new());
            enc.write_all(raw).unwrap();
            enc.into_inner().unwrap()
        }
    }
}

/// Gazette's name of a fragment of `raw` at `begin`, with `ext` as given.
pub fn gazette_name(begin: u64, raw: &[u8], ext: &str) -> String {
    let sha1 = Sha1::digest(raw);
    format!(
        "{begin:016x}-{:016x}-{}{ext}",
        begin + raw.len() as u64,
        hex::encode(sha1)
    )
}

/// The value of header `name` in a response head, if present.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Reads a history stream to its end: the chunks, and the error it ended
/// with, if any.
pub fn read_all(
    up: &Uploader,
    f: &StoredFragment,
    from: u64,
    chunk_max: usize,
) -> (Vec<HistoryChunk>, Option<StoreError>) {
    let rx = up.read(f, from, chunk_max);
    block_on(async move {
        let mut chunks = Vec::new();
        while let Ok(item) = rx.recv().await {
            match item {
                Ok(chunk) => chunks.push(chunk),
                Err(e) => {
                    assert!(rx.recv().await.is_err(), "an error ends the stream");
                    return (chunks, Some(e));
                }
            }
        }
        (chunks, None)
    })
}

/// Checks that chunks are contiguous from `from`, no larger than
/// `chunk_max`, and returns their bytes.
pub fn concat(chunks: &[HistoryChunk], from: u64, chunk_max: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut next = from;
    for c in chunks {
        assert_eq!(c.offset, next, "chunks are contiguous");
        assert!(!c.bytes.is_empty() && c.bytes.len() <= chunk_max);
        next += c.bytes.len() as u64;
        out.extend_from_slice(&c.bytes);
    }
    out
}

/// A plain HTTP/1.1 request to a loopback `http://` URL: (status, body).
pub fn http(method: &str, url: &str, body: &[u8]) -> (u16, Vec<u8>) {
    http_with(method, url, "", body)
}

/// [`http`] with extra header lines (each ending in `\r\n`).
pub fn http_with(method: &str, url: &str, headers: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let (status, _, body) = http_exchange(method, url, headers, body);
    (status, body)
}

/// [`http_with`], also giving the response's head (status line and
/// headers) as text.
pub fn http_exchange(
    method: &str,
    url: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s = TcpStream::connect(host).expect("connect");
    s.set_read_timeout(Some(WAIT)).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let split = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("HTTP head");
    let head = String::from_utf8_lossy(&resp[..split]).to_string();
    let mut body = resp[split + 4..].to_vec();
    let status: u16 = head.split(' ').nth(1).expect("status").parse().unwrap();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = unchunk(&body);
    }
    (status, head, body)
}

fn unchunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("chunk size");
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}
