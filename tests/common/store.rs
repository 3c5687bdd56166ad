//! Fragment stores for end-to-end tests: a `file://` directory, or a real
//! S3 endpoint (`moto_server`) on loopback. Tests look at what the broker
//! wrote themselves — directory listings, S3 ListObjectsV2 over plain HTTP
//! — and decode objects with each codec's own library.

use super::{free_port_range, kill_with_parent};
use rotary_net::spec::Codec;
use sha1::{Digest, Sha1};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the `moto_server` binary.
pub const MOTO_ENV: &str = "ROTARY_MOTO_SERVER";
/// Where `moto_server` is looked for when the variable is unset.
pub const MOTO_DEFAULT: &str = "/tmp/rotary-moto/bin/moto_server";
/// How long moto may take to answer HTTP after it starts (Python imports).
pub const MOTO_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Credentials moto accepts (any) and the broker's S3 client needs.
pub const AWS_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "test"),
    ("AWS_SECRET_ACCESS_KEY", "test"),
    ("AWS_REGION", "us-east-1"),
];
/// Bucket every S3 test store lives in.
pub const BUCKET: &str = "rotary-test";

/// moto answers anonymous GETs of objects with 403 but does not verify
/// signatures: any well-formed SigV4 Authorization header will do.
const MOTO_AUTHORIZATION: &str = "AWS4-HMAC-SHA256 \
    Credential=test/20250101/us-east-1/s3/aws4_request, \
    SignedHeaders=host;x-amz-date, Signature=0000";

fn http() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into()
}

/// A `moto_server` child on 127.0.0.1. Dropping it kills it by PID.
pub struct Moto {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    starts: u32,
}

impl Moto {
    /// Starts moto on a free port and creates [`BUCKET`]. Fails the test
    /// with instructions if the binary is missing.
    pub fn start() -> Moto {
        let mut m = Moto {
            child: None,
            port: free_port_range(1),
            dir: tempfile::Builder::new()
                .prefix("rotary-moto-")
                .tempdir()
                .expect("temp dir"),
            starts: 0,
        };
        m.spawn();
        m
    }

    fn binary() -> PathBuf {
        let path = std::env::var(MOTO_ENV)
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| MOTO_DEFAULT.to_string());
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "moto_server not found at {} (set {MOTO_ENV} to its path). The S3 tests need a real \
             S3 endpoint; install one with:\n  python3 -m venv /tmp/rotary-moto && \
             /tmp/rotary-moto/bin/pip install 'moto[server]'",
            path.display()
        );
        path
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("moto-{}.log", self.starts))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "moto already running");
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).expect("moto log");
        let mut cmd = Command::new(Moto::binary());
        cmd.args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("moto log"))
            .stderr(log);
        kill_with_parent(&mut cmd);
        self.child = Some(cmd.spawn().expect("spawn moto_server"));
        let deadline = Instant::now() + MOTO_READY_TIMEOUT;
        loop {
            if http().get(&self.url("/")).call().is_ok() {
                break;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("moto_server exited with {status}; log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "moto_server not answering on port {} after {MOTO_READY_TIMEOUT:?}; log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // moto keeps everything in memory: a (re)started server has no bucket.
        let r = http()
            .put(&self.url(&format!("/{BUCKET}")))
            .send(&[][..])
            .expect("create bucket");
        assert_eq!(r.status().as_u16(), 200, "PUT /{BUCKET}");
    }

    /// Kills the server (the store becomes unreachable).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the server keeps its port and takes connections, but
    /// answers nothing (a store that hangs) until [`Moto::resume`].
    pub fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&mut self, signal: libc::c_int) {
        let child = self.child.as_ref().expect("moto running");
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the PID of a child this harness spawned and has
        // not reaped, so the PID cannot have been reused.
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "signal {signal} to moto_server");
    }

    /// Starts it again on the same port, with an empty bucket.
    pub fn start_again(&mut self) {
        self.spawn();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// ListObjectsV2 under `prefix`: (key, size), sorted by key.
    pub fn list(&self, prefix: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut url = self.url(&format!(
                "/{BUCKET}?list-type=2&prefix={}",
                query_escape(prefix)
            ));
            if let Some(t) = &token {
                url.push_str(&format!("&continuation-token={}", query_escape(t)));
            }
            let mut r = http().get(&url).call().expect("list objects");
            let body = r.body_mut().read_to_string().expect("list body");
            assert_eq!(r.status().as_u16(), 200, "list {prefix}: {body}");
            for contents in body.split("<Contents>").skip(1) {
                let key = xml_unescape(between(contents, "<Key>", "</Key>").expect("Key"));
                let size = between(contents, "<Size>", "</Size>")
                    .expect("Size")
                    .parse()
                    .expect("Size is a number");
                out.push((key, size));
            }
            if between(&body, "<IsTruncated>", "</IsTruncated>") == Some("true") {
                token = Some(
                    between(&body, "<NextContinuationToken>", "</NextContinuationToken>")
                        .expect("NextContinuationToken")
                        .to_string(),
                );
            } else {
                break;
            }
        }
        out.sort();
        out
    }

    /// PUTs `bytes` at `key` with the given extra headers (such as
    /// `Content-Encoding`), as another writer of the bucket would.
    pub fn put(&self, key: &str, headers: &[(&str, &str)], bytes: &[u8]) {
        let mut req = http()
            .put(&self.url(&format!("/{BUCKET}/{}", path_escape(key))))
            .header("Authorization", MOTO_AUTHORIZATION)
            .header("x-amz-date", "20250101T000000Z");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let mut r = req.send(bytes).expect("put object");
        let body = r.body_mut().read_to_string().unwrap_or_default();
        assert_eq!(r.status().as_u16(), 200, "PUT {key}: {body}");
    }

    /// The object's `Content-Encoding`, if it has one.
    pub fn content_encoding(&self, key: &str) -> Option<String> {
        let r = http()
            .head(&self.url(&format!("/{BUCKET}/{}", path_escape(key))))
            .header("Authorization", MOTO_AUTHORIZATION)
            .header("x-amz-date", "20250101T000000Z")
            .call()
            .expect("head object");
        assert_eq!(r.status().as_u16(), 200, "HEAD {key}");
        r.headers()
            .get("content-encoding")
            .map(|v| v.to_str().expect("a text header").to_string())
    }

    pub fn get(&self, key: &str) -> Vec<u8> {
        let mut r = http()
            .get(&self.url(&format!("/{BUCKET}/{}", path_escape(key))))
            .header("Authorization", MOTO_AUTHORIZATION)
            .header("x-amz-date", "20250101T000000Z")
            .call()
            .expect("get object");
        assert_eq!(r.status().as_u16(), 200, "GET {key}");
        r.body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_vec()
            .expect("object body")
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- moto log (run {}) ---\n{}", self.starts, self.log());
        }
        self.stop();
    }
}

fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = s.find(open)? + open.len();
    let len = s[start..].find(close)?;
    Some(&s[start..start + len])
}

fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

fn escape(s: &str, keep_slash: bool) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn query_escape(s: &str) -> String {
    escape(s, false)
}

fn path_escape(s: &str) -> String {
    escape(s, true)
}

/// A fragment store a test points journals at.
pub enum TestStore {
    File {
        dir: tempfile::TempDir,
    },
    S3 {
        moto: Moto,
        /// Key prefix of this store inside [`BUCKET`], ending in `/`.
        prefix: String,
    },
}

impl TestStore {
    pub fn file() -> TestStore {
        TestStore::File {
            dir: tempfile::Builder::new()
                .prefix("rotary-store-")
                .tempdir()
                .expect("temp dir"),
        }
    }

    pub fn s3(prefix: &str) -> TestStore {
        assert!(prefix.ends_with('/'));
        TestStore::S3 {
            moto: Moto::start(),
            prefix: prefix.to_string(),
        }
    }

    pub fn is_s3(&self) -> bool {
        matches!(self, TestStore::S3 { .. })
    }

    /// The URL for `fragment.stores`.
    pub fn url(&self) -> String {
        match self {
            TestStore::File { dir } => format!("file://{}/", dir.path().display()),
            TestStore::S3 { moto, prefix } => format!(
                "s3://{BUCKET}/{prefix}?endpoint=http://127.0.0.1:{}&region=us-east-1&path_style=true",
                moto.port
            ),
        }
    }

    /// What the broker needs in its environment to use this store.
    pub fn broker_env(&self) -> Vec<(String, String)> {
        match self {
            TestStore::File { .. } => Vec::new(),
            TestStore::S3 { .. } => AWS_ENV
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    pub fn moto(&mut self) -> &mut Moto {
        match self {
            TestStore::S3 { moto, .. } => moto,
            TestStore::File { .. } => panic!("not an S3 store"),
        }
    }

    /// Every object of the store whose key (relative to the store URL)
    /// starts with `prefix`: (relative key, size), sorted.
    pub fn list(&self, prefix: &str) -> Vec<(String, u64)> {
        match self {
            TestStore::File { dir } => {
                let mut out = Vec::new();
                walk(dir.path(), dir.path(), &mut out);
                out.retain(|(k, _)| k.starts_with(prefix));
                out.sort();
                out
            }
            TestStore::S3 { moto, prefix: p } => moto
                .list(&format!("{p}{prefix}"))
                .into_iter()
                .map(|(k, size)| (k[p.len()..].to_string(), size))
                .collect(),
        }
    }

    /// The stored bytes of the object at `key` (relative to the store URL).
    pub fn get(&self, key: &str) -> Vec<u8> {
        match self {
            TestStore::File { dir } => std::fs::read(dir.path().join(key)).expect("read object"),
            TestStore::S3 { moto, prefix } => moto.get(&format!("{prefix}{key}")),
        }
    }

    /// Writes an object at `key` (relative to the store URL) as another
    /// writer of the store would: a file (directories made as needed), or
    /// an S3 object with `Content-Encoding: <content_encoding>` if given. A
    /// file has no such metadata: it holds the bytes only.
    pub fn put(&self, key: &str, bytes: &[u8], content_encoding: Option<&str>) {
        match self {
            TestStore::File { dir } => {
                let path = dir.path().join(key);
                std::fs::create_dir_all(path.parent().expect("a key names a file"))
                    .expect("object directory");
                std::fs::write(path, bytes).expect("write object");
            }
            TestStore::S3 { moto, prefix } => {
                let headers: Vec<(&str, &str)> = content_encoding
                    .map(|e| ("Content-Encoding", e))
                    .into_iter()
                    .collect();
                moto.put(&format!("{prefix}{key}"), &headers, bytes);
            }
        }
    }

    /// The object's `Content-Encoding` (always `None` in a file store).
    pub fn content_encoding(&self, key: &str) -> Option<String> {
        match self {
            TestStore::File { .. } => None,
            TestStore::S3 { moto, prefix } => moto.content_encoding(&format!("{prefix}{key}")),
        }
    }

    /// The fragments stored for `journal`: objects directly under
    /// `<journal>/` (not a longer journal's), each parsed from its name and
    /// checked: it decodes with its codec's library to bytes whose SHA-1 is
    /// the one in the name and whose length is `end - begin`. Objects with
    /// other names under `<journal>/` fail the test. Sorted by begin.
    pub fn fragments(&self, journal: &str) -> Vec<StoredFragment> {
        let dir = format!("{journal}/");
        let mut out = Vec::new();
        for (key, size) in self.list(&dir) {
            let name = &key[dir.len()..];
            if name.contains('/') {
                continue; // a longer journal's, e.g. `<journal>/child`
            }
            let parsed = parse_fragment_name(name)
                .unwrap_or_else(|| panic!("object {key:?} is not named <begin>-<end>-<sha1><ext>"));
            let stored = self.get(&key);
            assert_eq!(stored.len() as u64, size, "{key}: listed size");
            let bytes = decode(parsed.codec, &stored)
                .unwrap_or_else(|e| panic!("{key}: not valid {:?}: {e}", parsed.codec));
            assert_eq!(
                bytes.len() as u64,
                parsed.end - parsed.begin,
                "{key}: decoded length"
            );
            assert_eq!(
                hex::encode(Sha1::digest(&bytes)),
                parsed.sha1,
                "{key}: SHA-1 of the decoded bytes"
            );
            out.push(StoredFragment {
                key,
                size,
                bytes,
                ..parsed
            });
        }
        out.sort_by_key(|f| (f.begin, f.end));
        out
    }
}

/// Objects under `dir`. A `file://` store writes each object to a staging
/// file `<name>#<n>` and renames it into place, so staging files are not
/// objects, and a file may vanish between listing and stat.
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, u64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let Ok(e) = e else { continue };
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            walk(root, &path, out);
            continue;
        }
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let staging = rel
            .rsplit_once('#')
            .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !staging {
            out.push((rel, meta.len()));
        }
    }
}

/// One object of a store, decoded and checked.
#[derive(Clone, Debug)]
pub struct StoredFragment {
    /// Key relative to the store URL.
    pub key: String,
    pub begin: u64,
    pub end: u64,
    pub sha1: String,
    pub codec: Codec,
    /// Stored (compressed) size.
    pub size: u64,
    /// The decoded bytes.
    pub bytes: Vec<u8>,
}

/// Parses `<begin:016x>-<end:016x>-<sha1:40 hex><ext>` exactly as rotary
/// writes it: lower-case hex, the codec's own extension (none for
/// gzip-offload), no alias.
pub fn parse_fragment_name(name: &str) -> Option<StoredFragment> {
    const STEM_LEN: usize = 16 + 1 + 16 + 1 + 40;
    if name.len() < STEM_LEN || !name.is_char_boundary(STEM_LEN) {
        return None;
    }
    let (stem, ext) = name.split_at(STEM_LEN);
    let codec = Codec::ALL.into_iter().find(|c| c.extension() == ext)?;
    let parts: Vec<&str> = stem.split('-').collect();
    let lower_hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if parts.len() != 3
        || !lower_hex(parts[0], 16)
        || !lower_hex(parts[1], 16)
        || !lower_hex(parts[2], 40)
    {
        return None;
    }
    let begin = u64::from_str_radix(parts[0], 16).ok()?;
    let end = u64::from_str_radix(parts[1], 16).ok()?;
    if begin >= end {
        return None;
    }
    Some(StoredFragment {
        key: String::new(),
        begin,
        end,
        sha1: parts[2].to_string(),
        codec,
        size: 0,
        bytes: Vec::new(),
    })
}

/// Decodes stored bytes with the codec's own library.
pub fn decode(codec: Codec, stored: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    match codec {
        Codec::None => out.extend_from_slice(stored),
        Codec::Gzip | Codec::GzipOffload => {
            flate2::read::MultiGzDecoder::new(stored).read_to_end(&mut out)?;
        }
        Codec::Zstd => out = zstd::stream::decode_all(stored)?,
        Codec::Snappy => {
            snap::read::FrameDecoder::new(stored).read_to_end(&mut out)?;
        }
    }
    Ok(out)
}
