//! Writing a fragment to its store and reading it back, as streams: the
//! local file is read, hashed and compressed on a blocking thread in parts,
//! and each part is put while the next is made, so an upload holds a few
//! parts in memory whatever the fragment's length (a spec allows 1 TiB).
//!
//! A fragment that compresses to one part is put whole; a longer one is a
//! multipart upload, completed only once every byte of the file hashed to
//! the fragment's SHA-1, and aborted otherwise, so an object of the
//! fragment's name never holds bytes other than the named ones.
//!
//! A gzip-offload fragment is put to S3 with `Content-Encoding: gzip`, as
//! Gazette puts it: HTTP readers that leave decoding to their client get
//! the fragment's bytes. A `file://` store has no such metadata (and specs
//! do not let that codec write to one).

use crate::codec::HashingReader;
use crate::store::{Backend, Store};
use crate::{StoreError, UploadJob};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use object_store::{
    Attribute, Attributes, ObjectStoreExt, PutMultipartOptions, PutPayload, WriteMultipart,
};
use rotary_codec::{Decoder, Encoder};
use rotary_proto::spec::Codec;
use sha1::Digest;
use std::io::{self, Read, Write};
use std::path::Path;
use tokio::sync::mpsc;

/// Smallest part of a multipart upload. S3 wants 5 MiB at least (but the
/// last); parts grow for long fragments ([`part_bytes`]).
pub(crate) const UPLOAD_PART_BYTES_MIN: usize = 8 << 20;
/// Parts a store accepts in one upload (S3: 10,000), less a margin for
/// compression that grows incompressible bytes.
const UPLOAD_PARTS_MAX: u64 = 9_000;
/// Parts made but not yet handed to the store, per upload.
const UPLOAD_PARTS_QUEUED_MAX: usize = 1;
/// Parts being put at once, per upload.
const UPLOAD_PARTS_IN_FLIGHT_MAX: usize = 2;
/// Pieces of an object read back that wait for the decoder, per upload.
const READ_BACK_PIECES_QUEUED_MAX: usize = 4;

/// The part length for a fragment of `len` bytes: the minimum, or more for
/// a fragment that would need more parts than a store accepts. Memory per
/// upload is about `part_bytes * (UPLOAD_PARTS_QUEUED_MAX +
/// UPLOAD_PARTS_IN_FLIGHT_MAX + 1)`.
pub(crate) fn part_bytes(len: u64) -> usize {
    let need = len.div_ceil(UPLOAD_PARTS_MAX);
    (UPLOAD_PART_BYTES_MIN as u64).max(need.next_multiple_of(1 << 20)) as usize
}

/// Puts the job's fragment at `key`, compressed by its codec; returns the
/// object's length in bytes.
pub(crate) async fn put_fragment(
    store: &Store,
    job: &UploadJob,
    key: &str,
) -> Result<u64, StoreError> {
    let path = store.path(key)?;
    let part_len = part_bytes(job.end - job.begin);
    let (tx, mut rx) = mpsc::channel::<Bytes>(UPLOAD_PARTS_QUEUED_MAX);
    let (file, begin, end, sha1, codec) =
        (job.path.clone(), job.begin, job.end, job.sha1, job.codec);
    let producer = tokio::task::spawn_blocking(move || {
        compress_parts(&file, begin, end, sha1, codec, part_len, tx)
    });
    let producer_result = |r: Result<Result<u64, StoreError>, tokio::task::JoinError>| match r {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };

    let Some(first) = rx.recv().await else {
        // No part at all: the file could not be read, or its bytes are not
        // the fragment's.
        producer_result(producer.await)?;
        unreachable!("a fragment that compressed yields at least one part");
    };
    let Some(second) = rx.recv().await else {
        // One part: checked whole before anything is written.
        let written = producer_result(producer.await)?;
        debug_assert_eq!(written, first.len() as u64);
        store
            .object()
            .put_opts(
                &path,
                PutPayload::from(first),
                attributes(store, codec).into(),
            )
            .await
            .map_err(|e| store.err(key, e))?;
        return Ok(written);
    };

    let upload = store
        .object()
        .put_multipart_opts(&path, PutMultipartOptions::from(attributes(store, codec)))
        .await
        .map_err(|e| store.err(key, e))?;
    let mut upload = WriteMultipart::new_with_chunk_size(upload, part_len);
    let mut next = Some(second);
    upload.put(first);
    let pumped: Result<(), object_store::Error> = async {
        while let Some(part) = next.take() {
            upload.wait_for_capacity(UPLOAD_PARTS_IN_FLIGHT_MAX).await?;
            upload.put(part);
            next = rx.recv().await;
        }
        Ok(())
    }
    .await;
    // Stop the producer early if putting failed: dropping the receiver
    // makes its next send fail.
    drop(rx);
    let produced = producer_result(producer.await);
    match (pumped, produced) {
        (Ok(()), Ok(written)) => {
            upload.finish().await.map_err(|e| store.err(key, e))?;
            Ok(written)
        }
        (pumped, produced) => {
            let _ = upload.abort().await;
            match pumped {
                Err(e) => Err(store.err(key, e)),
                Ok(()) => Err(produced.expect_err("matched above")),
            }
        }
    }
}

/// The metadata an object of `codec` is put with: `Content-Encoding: gzip`
/// for gzip-offload in S3, nothing otherwise.
fn attributes(store: &Store, codec: Codec) -> Attributes {
    let mut attributes = Attributes::new();
    if codec == Codec::GzipOffload && matches!(store.backend, Backend::S3(_)) {
        attributes.insert(Attribute::ContentEncoding, "gzip".into());
    }
    attributes
}

/// Reads, hashes and compresses the local fragment, sending the compressed
/// bytes in parts of `part_len` (the last shorter). Blocking. Returns the
/// compressed length once every byte hashed to `sha1`.
fn compress_parts(
    path: &Path,
    begin: u64,
    end: u64,
    sha1: [u8; 20],
    codec: Codec,
    part_len: usize,
    tx: mpsc::Sender<Bytes>,
) -> Result<u64, StoreError> {
    let io_err = |e: io::Error| StoreError::local_io(path, &e);
    let corrupt = |why: String| StoreError::LocalCorrupt {
        path: path.to_path_buf(),
        why,
    };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let len = end - begin;
    let file_len = file.metadata().map_err(io_err)?.len();
    if file_len != len {
        return Err(corrupt(format!(
            "holds {file_len} bytes, the fragment is {len}"
        )));
    }
    let mut input = HashingReader::new(file.take(len));
    let sink = PartSink {
        part: BytesMut::with_capacity(part_len),
        part_len,
        tx,
        sent: 0,
    };
    let mut enc = Encoder::new(codec, sink).map_err(io_err)?;
    let copied = rotary_codec::copy(&mut input, &mut enc);
    if let Err(e) = copied {
        return Err(match e.kind() {
            io::ErrorKind::BrokenPipe => StoreError::Stopped,
            _ => io_err(e),
        });
    }
    if input.bytes != len {
        return Err(corrupt(format!(
            "read {} bytes, the fragment is {len}",
            input.bytes
        )));
    }
    let got: [u8; 20] = input.hasher.finalize().into();
    if got != sha1 {
        return Err(corrupt(format!(
            "bytes hash to {}, the fragment's SHA-1 is {}",
            hex::encode(got),
            hex::encode(sha1)
        )));
    }
    // Only now the last part goes: a receiver that got every part but the
    // last knows the bytes checked out once the producer returns Ok.
    let mut sink = enc.finish().map_err(io_err)?;
    sink.send_part().map_err(|_| StoreError::Stopped)?;
    Ok(sink.sent)
}

/// A `Write` that cuts what it is given into parts and sends each whole
/// one. `flush` does nothing: only full parts, and the last at the end,
/// are sent.
struct PartSink {
    part: BytesMut,
    part_len: usize,
    tx: mpsc::Sender<Bytes>,
    /// Bytes sent so far.
    sent: u64,
}

impl PartSink {
    fn send_part(&mut self) -> io::Result<()> {
        if self.part.is_empty() && self.sent > 0 {
            return Ok(());
        }
        let part = std::mem::replace(&mut self.part, BytesMut::with_capacity(self.part_len));
        self.sent += part.len() as u64;
        self.tx
            .blocking_send(part.freeze())
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "upload stopped"))
    }
}

impl Write for PartSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.part_len - self.part.len();
        let n = buf.len().min(room);
        self.part.extend_from_slice(&buf[..n]);
        if self.part.len() == self.part_len {
            self.send_part()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Reads the object at `key` back, streaming, and checks that it decodes
/// to the job's bytes. The outer error is the store's (fetching failed);
/// the inner one says how the object differs.
pub(crate) async fn reads_back_as_named(
    store: &Store,
    job: &UploadJob,
    key: &str,
) -> Result<Result<(), String>, StoreError> {
    let path = store.path(key)?;
    let mut stream = store
        .object()
        .get(&path)
        .await
        .map_err(|e| store.err(key, e))?
        .into_stream();
    let (tx, rx) = mpsc::channel::<Bytes>(READ_BACK_PIECES_QUEUED_MAX);
    let (codec, sha1, len) = (job.codec, job.sha1, job.end - job.begin);
    let check = tokio::task::spawn_blocking(move || {
        let source = PieceReader {
            rx,
            piece: Bytes::new(),
        };
        // One byte past the length tells a longer object apart.
        let mut decoded = HashingReader::new(Decoder::new(codec, source)?.take(len + 1));
        io::copy(&mut decoded, &mut io::sink())?;
        let got: [u8; 20] = decoded.hasher.finalize().into();
        Ok::<_, io::Error>(decoded.bytes == len && got == sha1)
    });
    let mut fetch_failed = None;
    while let Some(piece) = stream.next().await {
        match piece {
            // A decoder that stopped early (bad bytes) drops its receiver.
            Ok(piece) => {
                if tx.send(piece).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                fetch_failed = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let check = match check.await {
        Ok(check) => check,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    if let Some(e) = fetch_failed {
        return Err(store.err(key, e));
    }
    Ok(match check {
        Ok(true) => Ok(()),
        Ok(false) => Err("reads back as other bytes".into()),
        Err(e) => Err(format!("reads back undecodable: {e}")),
    })
}

/// A `Read` over the pieces of an object as they arrive. The end of the
/// pieces is the end of the object (or a failed fetch, which the caller
/// reports instead of what the decoder made of the short object).
struct PieceReader {
    rx: mpsc::Receiver<Bytes>,
    piece: Bytes,
}

impl Read for PieceReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.piece.is_empty() {
            match self.rx.blocking_recv() {
                Some(piece) => self.piece = piece,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.piece.len());
        buf[..n].copy_from_slice(&self.piece.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_stay_within_a_stores_count() {
        assert_eq!(part_bytes(0), UPLOAD_PART_BYTES_MIN);
        assert_eq!(part_bytes(1 << 30), UPLOAD_PART_BYTES_MIN);
        for len in [1u64 << 36, 1 << 40, (1 << 40) + 12345] {
            let part = part_bytes(len) as u64;
            assert!(len.div_ceil(part) <= UPLOAD_PARTS_MAX, "{len}");
            assert_eq!(part % (1 << 20), 0);
        }
    }

    #[test]
    fn a_part_sink_sends_whole_parts_then_the_rest() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut sink = PartSink {
            part: BytesMut::new(),
            part_len: 10,
            tx,
            sent: 0,
        };
        sink.write_all(&[1u8; 25]).unwrap();
        sink.send_part().unwrap();
        let got: Vec<usize> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|b| b.len())
            .collect();
        assert_eq!(got, [10, 10, 5]);
        assert_eq!(sink.sent, 25);
    }
}
