//! History reads: ranged GETs from a store on the pool's runtime feed a
//! decompressor on a blocking thread, which hashes every byte and sends
//! chunks on. The last chunk is held back until the whole fragment's
//! length and SHA-1 match its name, so a corrupt object is never served
//! whole: the stream ends with an error instead.

use crate::store::StoreError;
use crate::{HistoryChunk, Shared, StoredFragment};
use async_channel::{Receiver, Sender};
use bytes::Bytes;
use object_store::ObjectStoreExt;
use sha1::{Digest, Sha1};
use std::io::{self, Read};
use std::sync::Arc;

/// Bytes fetched per ranged GET: small enough that a slow reader never
/// holds one request open for long, large enough to amortize requests.
pub(crate) const RANGE_BYTES: u64 = 8 << 20;
/// Ranges fetched ahead of the decompressor.
const RANGES_AHEAD: usize = 2;
/// Decompressed chunks queued ahead of the reader.
pub(crate) const CHUNKS_AHEAD: usize = 4;

pub(crate) async fn read_task(
    shared: Arc<Shared>,
    fragment: StoredFragment,
    from: u64,
    chunk_max: usize,
    out: Sender<Result<HistoryChunk, StoreError>>,
) {
    let store = match shared.store(&fragment.store) {
        Ok(store) => store,
        Err(e) => {
            let _ = out.send(Err(e)).await;
            return;
        }
    };
    let path = match store.path(&fragment.key) {
        Ok(path) => path,
        Err(e) => {
            let _ = out.send(Err(e)).await;
            return;
        }
    };
    // The object's own size, not the listing's: objects are immutable, but
    // a listing may come from anywhere.
    let size = match store.object().head(&path).await {
        Ok(meta) => meta.size,
        Err(e) => {
            let _ = out.send(Err(store.err(&fragment.key, e))).await;
            return;
        }
    };
    let (raw_tx, raw_rx) = async_channel::bounded(RANGES_AHEAD);
    let decoding =
        tokio::task::spawn_blocking(move || decode(&fragment, from, chunk_max, raw_rx, size, &out));
    let mut offset = 0;
    while offset < size {
        let range_end = size.min(offset + RANGE_BYTES);
        let got = store.object().get_range(&path, offset..range_end).await;
        let stop = got.is_err();
        let sent = raw_tx
            .send(got.map_err(|e| store.err(path.as_ref(), e)))
            .await;
        if stop || sent.is_err() {
            break; // the store failed (the decoder reports it), or the reader left
        }
        offset = range_end;
    }
    drop(raw_tx);
    if let Err(e) = decoding.await {
        if e.is_panic() {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

/// Reads the compressed bytes of ranged GETs as they arrive.
struct RangeReader {
    ranges: Receiver<Result<Bytes, StoreError>>,
    current: Bytes,
    /// The object's size, and how much of it has arrived: ranges that stop
    /// short without an error mean the fetching task was dropped with the
    /// runtime, which is not the object's fault.
    size: u64,
    received: u64,
    /// The store error that ended the stream, if one did.
    failed: Option<StoreError>,
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.ranges.recv_blocking() {
                Ok(Ok(bytes)) => {
                    self.received += bytes.len() as u64;
                    self.current = bytes;
                }
                Ok(Err(e)) => {
                    let message = e.to_string();
                    self.failed = Some(e);
                    return Err(io::Error::other(message));
                }
                Err(_) if self.received < self.size => {
                    self.failed = Some(StoreError::Stopped);
                    return Err(io::Error::other("the read was stopped"));
                }
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        let _ = self.current.split_to(n);
        Ok(n)
    }
}

enum Flow {
    /// The fragment verified; here is the chunk held back, if any.
    Verified(Option<HistoryChunk>),
    /// The reader dropped its receiver.
    Abandoned,
}

fn decode(
    fragment: &StoredFragment,
    from: u64,
    chunk_max: usize,
    ranges: Receiver<Result<Bytes, StoreError>>,
    size: u64,
    out: &Sender<Result<HistoryChunk, StoreError>>,
) {
    let mut source = RangeReader {
        ranges,
        current: Bytes::new(),
        size,
        received: 0,
        failed: None,
    };
    let flow = decode_verified(fragment, from, chunk_max, &mut source, out);
    match flow {
        Ok(Flow::Verified(last)) => {
            if let Some(last) = last {
                let _ = out.send_blocking(Ok(last));
            }
        }
        Ok(Flow::Abandoned) => {}
        // A store failure surfaces from the decompressor as some I/O error:
        // report the store's own (retryable) error, not corruption.
        Err(e) => {
            let _ = out.send_blocking(Err(source.failed.take().unwrap_or(e)));
        }
    }
}

fn decode_verified(
    fragment: &StoredFragment,
    from: u64,
    chunk_max: usize,
    source: &mut RangeReader,
    out: &Sender<Result<HistoryChunk, StoreError>>,
) -> Result<Flow, StoreError> {
    let corrupt = |why: String| StoreError::Corrupt {
        store: fragment.store.clone(),
        key: fragment.key.clone(),
        why,
    };
    let mut decoder = rotary_codec::Decoder::new(fragment.codec, source)
        .map_err(|e| corrupt(format!("decompress: {e}")))?;
    let mut hasher = Sha1::new();
    let mut held: Option<HistoryChunk> = None;
    let mut offset = fragment.begin;
    let mut buf = vec![0u8; chunk_max];
    loop {
        let n = fill(&mut decoder, &mut buf).map_err(|e| corrupt(format!("decompress: {e}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        let chunk_end = offset + n as u64;
        if chunk_end > fragment.end {
            return Err(corrupt(format!(
                "holds more than the {} bytes its name says",
                fragment.end - fragment.begin
            )));
        }
        if chunk_end > from {
            let skip = from.saturating_sub(offset) as usize;
            let chunk = HistoryChunk {
                offset: offset.max(from),
                bytes: Bytes::copy_from_slice(&buf[skip..n]),
            };
            if let Some(ready) = held.replace(chunk) {
                if out.send_blocking(Ok(ready)).is_err() {
                    return Ok(Flow::Abandoned);
                }
            }
        }
        offset = chunk_end;
    }
    if offset != fragment.end {
        return Err(corrupt(format!(
            "holds {} bytes, its name says {}",
            offset - fragment.begin,
            fragment.end - fragment.begin
        )));
    }
    let sha1: [u8; 20] = hasher.finalize().into();
    if sha1 != fragment.sha1 {
        return Err(corrupt(format!(
            "bytes hash to {}, its name says {}",
            hex::encode(sha1),
            hex::encode(fragment.sha1)
        )));
    }
    Ok(Flow::Verified(held))
}

/// Reads until `buf` is full or the input ends.
fn fill(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
