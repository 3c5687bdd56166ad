//! Hashing what passes on the way to or from a codec (the codecs
//! themselves are `rotary_codec`'s). Blocking; runs on uploader threads.

use sha1::{Digest, Sha1};
use std::io::{self, Read};

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

#[cfg(test)]
mod tests {
    use super::*;
    use rotary_codec::{compress, Decoder};
    use rotary_proto::spec::Codec;

    #[test]
    fn hashes_and_counts_what_a_codec_reads() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for codec in Codec::ALL {
            let mut src = HashingReader::new(&data[..]);
            let packed = compress(codec, &mut src).unwrap();
            assert_eq!(src.bytes, data.len() as u64);
            let want: [u8; 20] = Sha1::digest(&data).into();
            assert_eq!(<[u8; 20]>::from(src.hasher.finalize()), want);
            let mut back = HashingReader::new(Decoder::new(codec, &packed[..]).unwrap());
            io::copy(&mut back, &mut io::sink()).unwrap();
            assert_eq!(back.bytes, data.len() as u64);
            assert_eq!(<[u8; 20]>::from(back.hasher.finalize()), want);
        }
    }
}
