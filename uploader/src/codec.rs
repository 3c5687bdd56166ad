//! Compression by a journal's codec, with each format's standard framing
//! so other tools read the objects: gzip (one member written, any number
//! read), zstd frames, and snappy's *framing* format (not raw snappy
//! blocks). Blocking; runs on uploader threads only.

use rotary_net::spec::Codec;
use sha1::{Digest, Sha1};
use std::io::{self, Read, Write};

/// zstd's default level: fast, and what Gazette's writers use.
const ZSTD_LEVEL: i32 = 3;

/// A reader that hashes and counts what passes through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    pub(crate) hasher: Sha1,
    pub(crate) bytes: u64,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha1::new(),
            bytes: 0,
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Bytes read from the input per step of compression.
const COPY_BUF_BYTES: usize = 256 << 10;

/// Compresses everything `input` yields into one buffer.
pub(crate) fn compress(codec: Codec, input: &mut impl Read) -> io::Result<Vec<u8>> {
    match codec {
        Codec::None => {
            let mut out = Vec::new();
            input.read_to_end(&mut out)?;
            Ok(out)
        }
        Codec::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            copy(input, &mut enc)?;
            enc.finish()
        }
        Codec::Zstd => {
            let mut enc = zstd::stream::write::Encoder::new(Vec::new(), ZSTD_LEVEL)?;
            enc.include_checksum(true)?;
            copy(input, &mut enc)?;
            enc.finish()
        }
        Codec::Snappy => {
            let mut enc = snap::write::FrameEncoder::new(Vec::new());
            copy(input, &mut enc)?;
            enc.flush()?;
            enc.into_inner().map_err(|e| e.into_error())
        }
    }
}

fn copy(input: &mut impl Read, output: &mut impl Write) -> io::Result<()> {
    let mut buf = vec![0u8; COPY_BUF_BYTES];
    loop {
        match input.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => output.write_all(&buf[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A reader of the decompressed bytes of `input`.
pub(crate) fn decoder<'a>(
    codec: Codec,
    input: impl Read + Send + 'a,
) -> io::Result<Box<dyn Read + Send + 'a>> {
    Ok(match codec {
        Codec::None => Box::new(input),
        Codec::Gzip => Box::new(flate2::read::MultiGzDecoder::new(input)),
        Codec::Zstd => Box::new(zstd::stream::read::Decoder::new(input)?),
        Codec::Snappy => Box::new(snap::read::FrameDecoder::new(input)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CODECS: [Codec; 4] = [Codec::None, Codec::Gzip, Codec::Zstd, Codec::Snappy];

    proptest! {
        #[test]
        fn round_trip(data in proptest::collection::vec(any::<u8>(), 0..100_000), idx in 0usize..4) {
            let codec = CODECS[idx];
            let mut src = HashingReader::new(&data[..]);
            let packed = compress(codec, &mut src).unwrap();
            prop_assert_eq!(src.bytes, data.len() as u64);
            let (got, want): ([u8; 20], [u8; 20]) = (src.hasher.finalize().into(), Sha1::digest(&data).into());
            prop_assert_eq!(got, want);
            let mut out = Vec::new();
            decoder(codec, &packed[..]).unwrap().read_to_end(&mut out).unwrap();
            prop_assert_eq!(out, data);
        }
    }

    #[test]
    fn corrupt_input_is_an_error() {
        let data = vec![7u8; 10_000];
        for codec in [Codec::Gzip, Codec::Zstd, Codec::Snappy] {
            let mut packed = compress(codec, &mut &data[..]).unwrap();
            let mid = packed.len() / 2;
            packed[mid] ^= 0xff;
            packed.truncate(packed.len() - 3);
            let mut out = Vec::new();
            let r = decoder(codec, &packed[..]).and_then(|mut d| d.read_to_end(&mut out));
            assert!(r.is_err() || out != data, "{codec:?}");
        }
    }
}
