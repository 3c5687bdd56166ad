//! Compression of fragments by a journal's [`Codec`], with each format's
//! standard framing so other tools (Gazette's among them) read the objects:
//! gzip (one member written, any number read), zstd frames with a content
//! checksum, and snappy's *framing* format (not raw snappy blocks).
//! Gzip-offload objects hold gzip bytes too (the store's `Content-Encoding`
//! is metadata beside them): they are written and read as gzip.
//!
//! Both directions stream: an [`Encoder`] is a `Write` over any sink and a
//! [`Decoder`] a `Read` over any source, each holding at most its format's
//! window, so a fragment of any length passes through bounded memory.
//! Blocking; it runs on whichever thread calls it (the uploader's blocking
//! threads, the client's blocking pool), never on a shard.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

use rotary_proto::spec::Codec;
use std::io::{self, BufReader, Read, Write};

/// zstd's default level: fast, and what Gazette's writers use.
const ZSTD_LEVEL: i32 = 3;

/// A writer that compresses what it is given into `W`.
// One lives per upload on a blocking thread's stack: the size of the
// largest variant is no cost worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Encoder<W: Write> {
    None(W),
    Gzip(flate2::write::GzEncoder<W>),
    Zstd(zstd::stream::write::Encoder<'static, W>),
    Snappy(snap::write::FrameEncoder<W>),
}

impl<W: Write> Encoder<W> {
    pub fn new(codec: Codec, sink: W) -> io::Result<Encoder<W>> {
        Ok(match codec {
            Codec::None => Encoder::None(sink),
            Codec::Gzip | Codec::GzipOffload => Encoder::Gzip(flate2::write::GzEncoder::new(
                sink,
                flate2::Compression::default(),
            )),
            Codec::Zstd => {
                let mut enc = zstd::stream::write::Encoder::new(sink, ZSTD_LEVEL)?;
                enc.include_checksum(true)?;
                Encoder::Zstd(enc)
            }
            Codec::Snappy => Encoder::Snappy(snap::write::FrameEncoder::new(sink)),
        })
    }

    /// Writes the format's trailer and gives back the sink, flushed.
    pub fn finish(self) -> io::Result<W> {
        let mut sink = match self {
            Encoder::None(w) => w,
            Encoder::Gzip(enc) => enc.finish()?,
            Encoder::Zstd(enc) => enc.finish()?,
            Encoder::Snappy(enc) => enc.into_inner().map_err(|e| e.into_error())?,
        };
        sink.flush()?;
        Ok(sink)
    }
}

impl<W: Write> Write for Encoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Encoder::None(w) => w.write(buf),
            Encoder::Gzip(enc) => enc.write(buf),
            Encoder::Zstd(enc) => enc.write(buf),
            Encoder::Snappy(enc) => enc.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Encoder::None(w) => w.flush(),
            Encoder::Gzip(enc) => enc.flush(),
            Encoder::Zstd(enc) => enc.flush(),
            Encoder::Snappy(enc) => enc.flush(),
        }
    }
}

/// A reader of the decompressed bytes of `R`. Bytes that are not a valid
/// stream of the codec are an `io::Error`, never a panic.
#[allow(clippy::large_enum_variant)] // as for `Encoder`
pub enum Decoder<R: Read> {
    None(R),
    Gzip(flate2::read::MultiGzDecoder<R>),
    Zstd(zstd::stream::read::Decoder<'static, BufReader<R>>),
    Snappy(snap::read::FrameDecoder<R>),
}

impl<R: Read> Decoder<R> {
    pub fn new(codec: Codec, source: R) -> io::Result<Decoder<R>> {
        Ok(match codec {
            Codec::None => Decoder::None(source),
            Codec::Gzip | Codec::GzipOffload => {
                Decoder::Gzip(flate2::read::MultiGzDecoder::new(source))
            }
            Codec::Zstd => Decoder::Zstd(zstd::stream::read::Decoder::new(source)?),
            Codec::Snappy => Decoder::Snappy(snap::read::FrameDecoder::new(source)),
        })
    }
}

impl<R: Read> Read for Decoder<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Decoder::None(r) => r.read(buf),
            Decoder::Gzip(d) => d.read(buf),
            Decoder::Zstd(d) => d.read(buf),
            Decoder::Snappy(d) => d.read(buf),
        }
    }
}

/// Bytes read from the input per step of [`copy`].
pub const COPY_BUF_BYTES: usize = 256 << 10;

/// Copies `input` into `output` through one buffer of [`COPY_BUF_BYTES`];
/// returns the bytes copied.
pub fn copy(input: &mut impl Read, output: &mut impl Write) -> io::Result<u64> {
    let mut buf = vec![0u8; COPY_BUF_BYTES];
    let mut total = 0u64;
    loop {
        match input.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => {
                output.write_all(&buf[..n])?;
                total += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Compresses everything `input` yields into one buffer (for tests and
/// small payloads; uploads stream through an [`Encoder`]).
pub fn compress(codec: Codec, input: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut enc = Encoder::new(codec, Vec::new())?;
    copy(input, &mut enc)?;
    enc.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(data in proptest::collection::vec(any::<u8>(), 0..100_000), codec in proptest::sample::select(Codec::ALL.to_vec())) {
            let packed = compress(codec, &mut &data[..]).unwrap();
            let mut out = Vec::new();
            Decoder::new(codec, &packed[..]).unwrap().read_to_end(&mut out).unwrap();
            prop_assert_eq!(out, data);
        }
    }

    #[test]
    fn formats_are_the_standard_ones() {
        let data = b"hello, fragment".repeat(100);
        // Each format's magic, so that other tools recognise the objects.
        let gz = compress(Codec::Gzip, &mut &data[..]).unwrap();
        assert_eq!(&gz[..2], &[0x1f, 0x8b]);
        let zst = compress(Codec::Zstd, &mut &data[..]).unwrap();
        assert_eq!(&zst[..4], &[0x28, 0xb5, 0x2f, 0xfd]);
        let sz = compress(Codec::Snappy, &mut &data[..]).unwrap();
        assert_eq!(&sz[..10], b"\xff\x06\x00\x00sNaPpY");
        assert_eq!(compress(Codec::None, &mut &data[..]).unwrap(), data);
        // Two gzip members read as one stream (Gazette's readers allow it).
        let mut two = gz.clone();
        two.extend_from_slice(&gz);
        let mut out = Vec::new();
        Decoder::new(Codec::Gzip, &two[..])
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out.len(), 2 * data.len());
    }

    /// A gzip-offload object as Gazette writes it: one gzip member of the
    /// fragment's bytes (made here by flate2 directly, not by `Encoder`).
    /// It decodes to those bytes; rotary writes the same format.
    #[test]
    fn gzip_offload_objects_are_gzip() {
        let data: Vec<u8> = (0..200_000u32)
            .map(|i| (i % 251) as u8 ^ (i >> 9) as u8)
            .collect();
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&data).unwrap();
        let object = enc.finish().unwrap();
        let mut out = Vec::new();
        Decoder::new(Codec::GzipOffload, &object[..])
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        assert!(out == data, "decoded {} bytes", out.len());
        let written = compress(Codec::GzipOffload, &mut &data[..]).unwrap();
        assert_eq!(&written[..2], &[0x1f, 0x8b]);
        let mut back = Vec::new();
        flate2::read::GzDecoder::new(&written[..])
            .read_to_end(&mut back)
            .unwrap();
        assert!(back == data);
        // Plain bytes are no gzip-offload object.
        let mut out = Vec::new();
        let r =
            Decoder::new(Codec::GzipOffload, &data[..]).and_then(|mut d| d.read_to_end(&mut out));
        assert!(r.is_err(), "plain bytes decoded to {} bytes", out.len());
    }

    #[test]
    fn corrupt_input_is_an_error() {
        let data = vec![7u8; 10_000];
        for codec in [Codec::Gzip, Codec::Zstd, Codec::Snappy, Codec::GzipOffload] {
            let mut packed = compress(codec, &mut &data[..]).unwrap();
            let mid = packed.len() / 2;
            packed[mid] ^= 0xff;
            packed.truncate(packed.len() - 3);
            let mut out = Vec::new();
            let r = Decoder::new(codec, &packed[..]).and_then(|mut d| d.read_to_end(&mut out));
            assert!(r.is_err() || out != data, "{codec:?}");
        }
    }
}
