//! Reading one fragment straight from its store, for direct reads.
//!
//! The broker answers a READ with DO_NOT_PROXY at a store-held offset with
//! the fragment's location (`file:///…` or a presigned `http(s)://…` URL),
//! its length and the SHA-1 of its uncompressed bytes. This module GETs the
//! object, decompresses it as it arrives and checks both length and SHA-1
//! before a single byte is handed to the reader: bytes that do not match
//! their name are never yielded.
//!
//! Fetching blocks (a file read or an HTTP GET), so callers run it on
//! tokio's blocking pool. A fragment is held in memory whole while it is
//! checked, which is why fragments longer than
//! [`FRAGMENT_DIRECT_LEN_MAX`] are read through the broker instead.

use crate::spec::Codec;
use sha1::{Digest, Sha1};
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Longest fragment a direct read fetches and checks in memory; longer
/// fragments are read through the broker.
pub const FRAGMENT_DIRECT_LEN_MAX: u64 = 1 << 30;
/// How long connecting to a store's HTTP endpoint may take.
pub const FETCH_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one read of an HTTP response (headers or a piece of the body)
/// may wait before the fetch is given up and the broker asked instead.
pub const FETCH_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A fetched fragment is read and hashed in pieces of this length.
const HASH_PIECE_LEN: u64 = 256 << 10;

/// Why a fragment could not be read from its store.
#[derive(Debug, thiserror::Error)]
pub enum FragmentError {
    /// The location is neither `file://` nor `http(s)://`.
    #[error("unsupported fragment location {0:?} (expected file:// or http(s)://)")]
    Location(String),
    /// The object could not be fetched: the store is unreachable from this
    /// client, refused the request, or the object is gone.
    #[error("fetching {location}: {source}")]
    Fetch {
        location: String,
        #[source]
        source: io::Error,
    },
    /// The object is longer than a direct read holds in memory.
    #[error("fragment {location} of {len} bytes exceeds the direct-read limit of {max}")]
    TooLong {
        location: String,
        len: u64,
        max: u64,
    },
    /// The object's bytes are not a valid stream of its codec.
    #[error("decoding {codec:?} fragment {location}: {source}")]
    Decode {
        location: String,
        codec: Codec,
        #[source]
        source: io::Error,
    },
    /// The object decodes to another length than its name says.
    #[error("fragment {location} decodes to {actual} bytes; its name says {expected}")]
    Length {
        location: String,
        expected: u64,
        /// Bytes decoded (at most `expected + 1`: decoding stops there).
        actual: u64,
    },
    /// The object's bytes do not hash to the SHA-1 in its name.
    #[error("fragment {location}: its bytes hash to SHA-1 {actual}, its name says {expected}")]
    Sha1 {
        location: String,
        expected: String,
        actual: String,
    },
}

impl FragmentError {
    /// Whether the client could not get at the object at all (as opposed to
    /// getting bytes that are wrong). Then reading the same offsets through
    /// the broker may still work; wrong bytes are never used.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            FragmentError::Location(_)
                | FragmentError::Fetch { .. }
                | FragmentError::TooLong { .. }
        )
    }
}

/// What a READ_FRAGMENT names: the fragment and where it lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FragmentRef {
    pub begin: u64,
    pub end: u64,
    pub sha1: [u8; 20],
    pub codec: Codec,
    pub location: String,
}

/// The HTTP agent direct reads share. No transparent decompression: the
/// body must be the stored bytes, whatever Content-Encoding says.
pub(crate) fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_connect(Some(FETCH_CONNECT_TIMEOUT))
        .timeout_recv_response(Some(FETCH_READ_TIMEOUT))
        .timeout_per_read(Some(FETCH_READ_TIMEOUT))
        .http_status_as_error(true)
        .build()
        .into()
}

/// Fetches, decodes and checks a whole fragment. Blocking.
#[cfg(test)]
pub(crate) fn fetch_fragment(
    agent: &ureq::Agent,
    fragment: &FragmentRef,
) -> Result<Vec<u8>, FragmentError> {
    fetch_fragment_into(agent, fragment, Vec::new())
}

/// [`fetch_fragment`] into `bytes` (emptied first): a buffer used before
/// has its memory mapped already, so reading into it costs no page faults.
pub(crate) fn fetch_fragment_into(
    agent: &ureq::Agent,
    fragment: &FragmentRef,
    mut bytes: Vec<u8>,
) -> Result<Vec<u8>, FragmentError> {
    assert!(fragment.begin <= fragment.end, "checked on decode");
    let location = &fragment.location;
    let len = fragment.end - fragment.begin;
    if len > FRAGMENT_DIRECT_LEN_MAX {
        return Err(FragmentError::TooLong {
            location: location.clone(),
            len,
            max: FRAGMENT_DIRECT_LEN_MAX,
        });
    }
    let fetch_err = |source: io::Error| FragmentError::Fetch {
        location: location.clone(),
        source,
    };
    let source: Box<dyn Read> = if let Some(path) = location.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(FragmentError::Location(location.clone()));
        }
        Box::new(open_file(path).map_err(fetch_err)?)
    } else if location.starts_with("http://") || location.starts_with("https://") {
        let response = agent
            .get(location.as_str())
            .call()
            .map_err(|e| fetch_err(e.into_io()))?;
        Box::new(response.into_body().into_reader())
    } else {
        return Err(FragmentError::Location(location.clone()));
    };
    let failed = Arc::new(AtomicBool::new(false));
    let transport = Transport {
        inner: source,
        failed: failed.clone(),
    };
    let decode_err = |source: io::Error| {
        if failed.load(Ordering::Relaxed) {
            fetch_err(source)
        } else {
            FragmentError::Decode {
                location: location.clone(),
                codec: fragment.codec,
                source,
            }
        }
    };
    let decoder = rotary_codec::Decoder::new(fragment.codec, transport).map_err(decode_err)?;
    // One byte past the expected length tells a too-long object apart.
    // Each piece is hashed as it arrives, while it is still in cache.
    let mut decoder = decoder.take(len + 1);
    bytes.clear();
    bytes.reserve_exact(len as usize);
    let mut hasher = Sha1::new();
    loop {
        let at = bytes.len();
        let n = (&mut decoder)
            .take(HASH_PIECE_LEN)
            .read_to_end(&mut bytes)
            .map_err(decode_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&bytes[at..]);
    }
    if bytes.len() as u64 != len {
        return Err(FragmentError::Length {
            location: location.clone(),
            expected: len,
            actual: bytes.len() as u64,
        });
    }
    let actual: [u8; 20] = hasher.finalize().into();
    if actual != fragment.sha1 {
        return Err(FragmentError::Sha1 {
            location: location.clone(),
            expected: hex::encode(fragment.sha1),
            actual: hex::encode(actual),
        });
    }
    Ok(bytes)
}

/// Opens a `file://` path: as written, or percent-decoded if that names
/// no file (journal names may hold `%`, which a URL may or may not escape).
fn open_file(path: &str) -> io::Result<std::fs::File> {
    match std::fs::File::open(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && path.contains('%') => {
            match percent_decode(path) {
                Some(decoded) if decoded != path => std::fs::File::open(decoded).map_err(|_| e),
                _ => Err(e),
            }
        }
        r => r,
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The object's byte source; remembers whether it failed, so that a
/// transport error is not mistaken for bad bytes once a decoder wraps it.
struct Transport {
    inner: Box<dyn Read>,
    failed: Arc<AtomicBool>,
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf).inspect_err(|_| {
            self.failed.store(true, Ordering::Relaxed);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn encode(codec: Codec, raw: &[u8]) -> Vec<u8> {
        match codec {
            Codec::None => raw.to_vec(),
            Codec::Gzip | Codec::GzipOffload => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(raw).unwrap();
                e.finish().unwrap()
            }
            Codec::Zstd => zstd::stream::encode_all(raw, 1).unwrap(),
            Codec::Snappy => {
                let mut e = snap::write::FrameEncoder::new(Vec::new());
                e.write_all(raw).unwrap();
                e.into_inner().unwrap()
            }
        }
    }

    fn fragment_file(
        dir: &std::path::Path,
        codec: Codec,
        stored: &[u8],
        raw: &[u8],
    ) -> FragmentRef {
        let sha1: [u8; 20] = Sha1::digest(raw).into();
        let name = format!(
            "{:016x}-{:016x}-{}{}",
            100,
            100 + raw.len(),
            hex::encode(sha1),
            codec.extension()
        );
        let path = dir.join(name);
        std::fs::write(&path, stored).unwrap();
        FragmentRef {
            begin: 100,
            end: 100 + raw.len() as u64,
            sha1,
            codec,
            location: format!("file://{}", path.display()),
        }
    }

    #[test]
    fn every_codec_round_trips_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let agent = http_agent();
        let raw: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        for codec in Codec::ALL {
            let f = fragment_file(dir.path(), codec, &encode(codec, &raw), &raw);
            assert_eq!(fetch_fragment(&agent, &f).unwrap(), raw, "{codec:?}");

            // Another fragment's bytes under this name: refused.
            let mut other = raw.clone();
            other[777] ^= 1;
            let bad = fragment_file(dir.path(), codec, &encode(codec, &other), &raw);
            let err = fetch_fragment(&agent, &bad).unwrap_err();
            assert!(
                matches!(err, FragmentError::Sha1 { .. }),
                "{codec:?}: {err}"
            );
            assert!(!err.is_unreachable());

            // Too short and too long are length errors.
            let short = fragment_file(dir.path(), codec, &encode(codec, &raw[1..]), &raw);
            let err = fetch_fragment(&agent, &short).unwrap_err();
            assert!(
                matches!(err, FragmentError::Length { .. }),
                "{codec:?}: {err}"
            );
            let mut longer = raw.clone();
            longer.push(1);
            let long = fragment_file(dir.path(), codec, &encode(codec, &longer), &raw);
            let err = fetch_fragment(&agent, &long).unwrap_err();
            assert!(
                matches!(err, FragmentError::Length { actual, expected, .. } if actual == expected + 1),
                "{codec:?}: {err}"
            );
        }
        // Garbage is a decode error for compressed codecs.
        for codec in [Codec::Gzip, Codec::Zstd, Codec::Snappy, Codec::GzipOffload] {
            let f = fragment_file(dir.path(), codec, b"definitely not compressed", &raw);
            let err = fetch_fragment(&agent, &f).unwrap_err();
            assert!(
                matches!(err, FragmentError::Decode { .. }),
                "{codec:?}: {err}"
            );
        }
    }

    /// A gzip-offload object served as S3 serves it, with `Content-Encoding:
    /// gzip`: the body arrives as stored (the agent decodes nothing) and is
    /// gunzipped once, here.
    #[test]
    fn gzip_offload_over_http_is_decoded_once() {
        use std::io::{BufRead, BufReader};
        let raw: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let body = encode(Codec::GzipOffload, &raw);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = String::new();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if line == "\r\n" || line.is_empty() {
                    break;
                }
                request.push_str(&line);
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes()).unwrap();
            conn.write_all(&body).unwrap();
            request
        });
        let f = FragmentRef {
            begin: 0,
            end: raw.len() as u64,
            sha1: Sha1::digest(&raw).into(),
            codec: Codec::GzipOffload,
            location: format!("http://127.0.0.1:{port}/bucket/j/x"),
        };
        assert!(fetch_fragment(&http_agent(), &f).unwrap() == raw);
        let request = server.join().unwrap().to_ascii_lowercase();
        assert!(request.starts_with("get /bucket/j/x "), "{request}");
        // Nothing asked the store to encode: what it holds is what comes.
        assert!(!request.contains("accept-encoding: gzip"), "{request}");
    }

    #[test]
    fn unreachable_locations_are_told_apart() {
        let agent = http_agent();
        let mut f = FragmentRef {
            begin: 0,
            end: 10,
            sha1: [0; 20],
            codec: Codec::None,
            location: "file:///nonexistent/rotary/fragment.raw".into(),
        };
        assert!(matches!(
            fetch_fragment(&agent, &f).unwrap_err(),
            FragmentError::Fetch { .. }
        ));
        f.location = "gs://bucket/x".into();
        assert!(fetch_fragment(&agent, &f).unwrap_err().is_unreachable());
        // A port nobody listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        f.location = format!("http://127.0.0.1:{port}/bucket/x.raw");
        let err = fetch_fragment(&agent, &f).unwrap_err();
        assert!(matches!(err, FragmentError::Fetch { .. }), "{err}");
        f.end = FRAGMENT_DIRECT_LEN_MAX + 1;
        assert!(matches!(
            fetch_fragment(&agent, &f).unwrap_err(),
            FragmentError::TooLong { .. }
        ));
    }

    #[test]
    fn percent_escaped_paths() {
        assert_eq!(percent_decode("/a/b%3Dc%25").as_deref(), Some("/a/b=c%"));
        assert_eq!(percent_decode("/a/%zz"), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j=1%");
        std::fs::write(&path, b"x").unwrap();
        let escaped = format!("{}/j%3D1%25", dir.path().display());
        assert!(open_file(&escaped).is_ok());
        assert!(open_file(&path.display().to_string()).is_ok());
    }
}
