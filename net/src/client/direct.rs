//! Direct reads: history from the store, the rest from the broker.
//!
//! A [`DirectRead`] sends READ with DO_NOT_PROXY. Where the broker holds the
//! bytes it streams them as usual; where only a fragment store does, it
//! answers READ_FRAGMENT (the fragment's location) and READ_DONE at the
//! fragment's end. The reader then fetches the object itself
//! ([`super::fetch`]), checks it, yields its bytes from the requested
//! offset, and sends a new READ at the fragment's end: one offset space
//! across the history → live handoff, with the broker out of the way of the
//! bulk of the bytes.
//!
//! If the object cannot be fetched (the store is unreachable from this
//! client, a presigned URL expired, the fragment is too long to check in
//! memory) the same span is read through the broker instead. Bytes that do
//! not match the fragment's SHA-1 are never yielded: that ends the read
//! with [`ClientError::Fragment`].

use super::fetch::{fetch_fragment, FragmentRef};
use super::{Client, ClientError, ProtocolError, ReadDone, ReadEvent, ReadOptions, ReadStream};
use crate::status::Status;
use crate::wire::ReadRequest;
use bytes::Bytes;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Counters of one [`DirectRead`], readable while it runs.
#[derive(Debug, Default)]
pub struct DirectReadStats {
    /// Fragments fetched from their store and checked.
    pub fragments_fetched: AtomicU64,
    /// Fragments whose store could not be reached, read through the broker.
    pub fragments_proxied: AtomicU64,
    /// READ requests sent to the broker.
    pub reads: AtomicU64,
}

/// Checked fragment bytes are handed out in pieces of at most this length,
/// like the broker's READ_DATA frames.
pub const DIRECT_DATA_LEN_MAX: usize = 1 << 20;

type Step =
    Pin<Box<dyn Future<Output = (Box<State>, Option<Result<ReadEvent, ClientError>>)> + Send>>;

/// A read that fetches store-held history directly. Yields
/// [`ReadEvent::Data`] items (offsets increase; a jump forward marks
/// missing history, as with [`ReadStream`]) and ends with one
/// [`ReadEvent::Done`]; never [`ReadEvent::Fragment`]. Also a
/// `futures_core::Stream`. Dropping it cancels the broker read in flight.
pub struct DirectRead {
    state: Option<Box<State>>,
    step: Option<Step>,
    stats: Arc<DirectReadStats>,
}

impl std::fmt::Debug for DirectRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectRead")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

struct State {
    client: Client,
    journal: String,
    /// Next offset to read; `None` (the write head) only before the first READ.
    offset: Option<u64>,
    end_offset: Option<u64>,
    block: bool,
    /// The broker read in flight.
    stream: Option<ReadStream>,
    /// A READ_FRAGMENT of the read in flight, awaiting its READ_DONE.
    fragment: Option<(FragmentRef, u64)>,
    /// Reading through the broker up to this offset: the store was unreachable.
    proxy_until: Option<u64>,
    /// Events ready to hand out (the checked bytes of a fetched fragment).
    queued: VecDeque<ReadEvent>,
    finished: bool,
    stats: Arc<DirectReadStats>,
}

impl DirectRead {
    pub(crate) fn new(client: Client, req: &ReadRequest, block: bool) -> DirectRead {
        let stats = Arc::new(DirectReadStats::default());
        DirectRead {
            state: Some(Box::new(State {
                client,
                journal: req.journal.clone(),
                offset: req.offset,
                end_offset: req.end_offset,
                block,
                stream: None,
                fragment: None,
                proxy_until: None,
                queued: VecDeque::new(),
                finished: false,
                stats: stats.clone(),
            })),
            step: None,
            stats,
        }
    }

    /// The next item; `None` after [`ReadEvent::Done`] or an error.
    pub async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// How the read went so far.
    pub fn stats(&self) -> &DirectReadStats {
        &self.stats
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<ReadEvent, ClientError>>> {
        if self.step.is_none() {
            let Some(mut state) = self.state.take() else {
                return Poll::Ready(None);
            };
            self.step = Some(Box::pin(async move {
                let item = state.next().await;
                (state, item)
            }));
        }
        let step = self.step.as_mut().expect("set above");
        match step.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready((state, item)) => {
                self.step = None;
                self.state = Some(state);
                Poll::Ready(item)
            }
        }
    }
}

impl futures_core::Stream for DirectRead {
    type Item = Result<ReadEvent, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl State {
    fn fail(&mut self, e: ClientError) -> Option<Result<ReadEvent, ClientError>> {
        self.finished = true;
        self.stream = None;
        Some(Err(e))
    }

    fn protocol(&self, source: ProtocolError) -> ClientError {
        ClientError::Protocol {
            endpoint: self.client.endpoint().to_string(),
            source,
        }
    }

    async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        loop {
            if let Some(ev) = self.queued.pop_front() {
                if let ReadEvent::Done(_) = ev {
                    self.finished = true;
                }
                return Some(Ok(ev));
            }
            if self.finished {
                return None;
            }
            if self.stream.is_none() {
                match self.start().await {
                    Ok(s) => self.stream = Some(s),
                    Err(e) => return self.fail(e),
                }
            }
            let stream = self.stream.as_mut().expect("started above");
            let ev = match stream.next().await {
                Some(Ok(ev)) => ev,
                Some(Err(e)) => return self.fail(e),
                None => return self.fail(self.protocol(ProtocolError::Truncated)),
            };
            match ev {
                ReadEvent::Data { offset, content } => {
                    self.offset = Some(offset + content.len() as u64);
                    return Some(Ok(ReadEvent::Data { offset, content }));
                }
                ReadEvent::Fragment {
                    begin,
                    end,
                    offset,
                    sha1,
                    codec,
                    location,
                } => {
                    if self.proxy_until.is_some() || self.fragment.is_some() {
                        // A proxied read never answers with a location, and
                        // a read answers with at most one.
                        return self.fail(self.protocol(ProtocolError::UnexpectedOp {
                            request: crate::wire::Op::READ,
                            got: crate::wire::Op::READ_FRAGMENT,
                        }));
                    }
                    let f = FragmentRef {
                        begin,
                        end,
                        sha1,
                        codec,
                        location,
                    };
                    self.fragment = Some((f, offset));
                }
                ReadEvent::Done(done) => {
                    self.stream = None;
                    let first_read = self.stats.reads.load(Ordering::Relaxed) == 1;
                    if let Some(item) = self.on_done(done, first_read).await {
                        return Some(item);
                    }
                }
            }
        }
    }

    /// Sends the next READ: direct from `offset`, or through the broker up
    /// to `proxy_until`.
    async fn start(&mut self) -> Result<ReadStream, ClientError> {
        let end_offset = match (self.proxy_until, self.end_offset) {
            (Some(p), Some(e)) => Some(p.min(e)),
            (Some(p), None) => Some(p),
            (None, e) => e,
        };
        let req = ReadRequest {
            journal: self.journal.clone(),
            offset: self.offset,
            end_offset,
        };
        let direct = self.proxy_until.is_none();
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.client
            .read_with(
                &req,
                ReadOptions {
                    // A proxied span lies below the head: no need to wait.
                    block: self.block && direct,
                    metadata_only: false,
                    do_not_proxy: direct,
                },
            )
            .await
    }

    /// A READ ended. Returns the item to hand out, or `None` to go on with
    /// another READ (or queued bytes).
    async fn on_done(
        &mut self,
        done: ReadDone,
        first_read: bool,
    ) -> Option<Result<ReadEvent, ClientError>> {
        if done.status != Status::OK {
            self.fragment = None;
            self.finished = true;
            // Once bytes were handed out, the read as a whole started below
            // the head: reaching the head is its normal end, as it is for a
            // single broker read.
            if done.status == Status::OFFSET_NOT_YET_AVAILABLE && !first_read && !self.block {
                return Some(Ok(ReadEvent::Done(ReadDone {
                    status: Status::OK,
                    message: String::new(),
                    ..done
                })));
            }
            return Some(Ok(ReadEvent::Done(done)));
        }
        if let Some((fragment, from)) = self.fragment.take() {
            // ReadStream checked begin <= from < end.
            let agent = self.client.http_agent();
            let f = fragment.clone();
            let fetched = tokio::task::spawn_blocking(move || fetch_fragment(&agent, &f)).await;
            let fetched = match fetched {
                Ok(r) => r,
                Err(join) => {
                    return self.fail(ClientError::Io {
                        endpoint: fragment.location.clone(),
                        source: Arc::new(std::io::Error::other(join.to_string())),
                    })
                }
            };
            match fetched {
                Ok(bytes) => {
                    self.stats.fragments_fetched.fetch_add(1, Ordering::Relaxed);
                    self.queue_fragment(&fragment, from, Bytes::from(bytes), done.write_head);
                }
                Err(e) if e.is_unreachable() => {
                    self.stats.fragments_proxied.fetch_add(1, Ordering::Relaxed);
                    self.offset = Some(from);
                    self.proxy_until = Some(fragment.end);
                }
                Err(e) => return self.fail(ClientError::Fragment(e)),
            }
            return None;
        }
        self.offset = Some(done.offset);
        let at_end = self.end_offset.is_some_and(|e| done.offset >= e);
        if let Some(until) = self.proxy_until {
            if done.offset >= until && !at_end {
                // Past the unreachable fragment: back to direct reads.
                self.proxy_until = None;
                return None;
            }
        }
        self.finished = true;
        Some(Ok(ReadEvent::Done(done)))
    }

    /// Queues a checked fragment's bytes from `from` (up to the read's end
    /// offset) in READ_DATA-sized pieces, then goes on at its end.
    fn queue_fragment(&mut self, f: &FragmentRef, from: u64, bytes: Bytes, write_head: u64) {
        let to = self.end_offset.map_or(f.end, |e| e.min(f.end));
        let mut at = from;
        while at < to {
            let n = (to - at).min(DIRECT_DATA_LEN_MAX as u64);
            let lo = (at - f.begin) as usize;
            self.queued.push_back(ReadEvent::Data {
                offset: at,
                content: bytes.slice(lo..lo + n as usize),
            });
            at += n;
        }
        self.offset = Some(to);
        if self.end_offset.is_some_and(|e| to >= e) {
            self.queued.push_back(ReadEvent::Done(ReadDone {
                offset: to,
                write_head,
                status: Status::OK,
                message: String::new(),
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::FragmentError;
    use crate::spec::Codec;
    use crate::wire::{self, flag, Op};
    use sha1::{Digest, Sha1};
    use std::sync::Mutex;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use zerocopy::byteorder::little_endian::U64;
    use zerocopy::IntoBytes;

    /// A READ the fake broker received: (offset, end_offset, flags).
    type Seen = Arc<Mutex<Vec<(Option<u64>, Option<u64>, u8)>>>;

    /// A fake broker holding `journal` whose bytes `[store.0, store.1)` live
    /// only in a store at `location`; everything else it serves itself.
    async fn fake_broker(journal: Vec<u8>, store: (u64, u64), location: String) -> (String, Seen) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen: Seen = Arc::default();
        let (endpoint, seen2) = (addr.clone(), seen.clone());
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut tmp = vec![0u8; 1 << 16];
            let head = journal.len() as u64;
            loop {
                let Some((f, used)) = wire::decode_frame(&buf, wire::BODY_LEN_MAX).unwrap() else {
                    let n = sock.read(&mut tmp).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    continue;
                };
                let mut out = Vec::new();
                let id = f.request_id;
                match f.op {
                    Op::ROUTE => {
                        let body = serde_json::json!({"journal": wire::decode_name(f.meta).unwrap(),
                            "shard": 0, "shards": 1, "endpoint": endpoint});
                        wire::encode_frame(
                            &mut out,
                            Op::ADMIN_REPLY,
                            0,
                            Status::OK,
                            id,
                            &[],
                            body.to_string().as_bytes(),
                        );
                    }
                    Op::READ => {
                        let req = ReadRequest::decode(f.meta).unwrap();
                        seen2
                            .lock()
                            .unwrap()
                            .push((req.offset, req.end_offset, f.flags));
                        let from = req.offset.unwrap_or(head);
                        let end = req.end_offset.unwrap_or(head).min(head);
                        let direct = f.flags & flag::DO_NOT_PROXY != 0;
                        let data_to = if direct && from < store.1 {
                            store.0.max(from).min(end)
                        } else {
                            end
                        };
                        let mut at = from;
                        while at < data_to {
                            let n = (data_to - at).min(1000);
                            let meta = wire::ReadData {
                                offset: U64::new(at),
                            };
                            wire::encode_frame(
                                &mut out,
                                Op::READ_DATA,
                                0,
                                Status::OK,
                                id,
                                meta.as_bytes(),
                                &journal[at as usize..(at + n) as usize],
                            );
                            at += n;
                        }
                        let (status, next) = if direct && at >= store.0 && at < store.1 && at < end
                        {
                            let meta = wire::ReadFragment {
                                begin: U64::new(store.0),
                                end: U64::new(store.1),
                                offset: U64::new(at),
                                sha1: Sha1::digest(&journal[store.0 as usize..store.1 as usize])
                                    .into(),
                                codec: wire::codec_code(Codec::None),
                                reserved: [0; 3],
                            };
                            wire::encode_frame(
                                &mut out,
                                Op::READ_FRAGMENT,
                                0,
                                Status::OK,
                                id,
                                meta.as_bytes(),
                                location.as_bytes(),
                            );
                            (Status::OK, store.1)
                        } else if from >= head {
                            (Status::OFFSET_NOT_YET_AVAILABLE, from)
                        } else {
                            (Status::OK, at)
                        };
                        let meta = wire::ReadDone {
                            offset: U64::new(next),
                            write_head: U64::new(head),
                        };
                        wire::encode_frame(
                            &mut out,
                            Op::READ_DONE,
                            0,
                            status,
                            id,
                            meta.as_bytes(),
                            &[],
                        );
                    }
                    Op::CANCEL => {}
                    other => panic!("unexpected {other:?}"),
                }
                sock.write_all(&out).await.unwrap();
                buf.drain(..used);
            }
        });
        (addr, seen)
    }

    async fn collect(mut r: DirectRead) -> (Vec<u8>, ReadDone) {
        let mut out = Vec::new();
        let mut from = None;
        while let Some(ev) = r.next().await {
            match ev.unwrap() {
                ReadEvent::Data { offset, content } => {
                    let start = *from.get_or_insert(offset);
                    assert_eq!(offset, start + out.len() as u64, "contiguous");
                    out.extend_from_slice(&content);
                }
                ReadEvent::Fragment { .. } => panic!("a direct read yields no locations"),
                ReadEvent::Done(d) => return (out, d),
            }
        }
        panic!("ended without Done")
    }

    fn journal() -> Vec<u8> {
        (0..10_000u32).map(|i| (i * 7 % 253) as u8).collect()
    }

    fn req(offset: u64, end: Option<u64>) -> ReadRequest {
        ReadRequest {
            journal: "test/direct".into(),
            offset: Some(offset),
            end_offset: end,
        }
    }

    #[tokio::test]
    async fn fetches_store_fragments_and_rejoins_the_broker() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal();
        let path = dir.path().join("frag.raw");
        std::fs::write(&path, &j[2000..7000]).unwrap();
        let (addr, seen) = fake_broker(
            j.clone(),
            (2000, 7000),
            format!("file://{}", path.display()),
        )
        .await;
        let client = Client::connect(&addr).await.unwrap();

        let r = client.read_direct(&req(500, None), false);
        let stats = r.stats.clone();
        let (bytes, done) = collect(r).await;
        assert_eq!(bytes, j[500..]);
        assert_eq!(
            (done.status, done.offset, done.write_head),
            (Status::OK, 10_000, 10_000)
        );
        assert_eq!(stats.fragments_fetched.load(Ordering::Relaxed), 1);
        assert_eq!(stats.fragments_proxied.load(Ordering::Relaxed), 0);
        let reads = std::mem::take(&mut *seen.lock().unwrap());
        assert_eq!(
            reads,
            vec![
                (Some(500), None, flag::DO_NOT_PROXY),
                (Some(7000), None, flag::DO_NOT_PROXY)
            ]
        );

        // Starting inside the fragment, ending inside it.
        let (bytes, done) = collect(client.read_direct(&req(3000, Some(4000)), false)).await;
        assert_eq!(bytes, j[3000..4000]);
        assert_eq!((done.status, done.offset), (Status::OK, 4000));

        // At the head, a non-blocking read has nothing.
        let (bytes, done) = collect(client.read_direct(&req(10_000, None), false)).await;
        assert!(bytes.is_empty());
        assert_eq!(done.status, Status::OFFSET_NOT_YET_AVAILABLE);
    }

    #[tokio::test]
    async fn unreachable_store_falls_back_to_the_broker() {
        let j = journal();
        let (addr, seen) = fake_broker(
            j.clone(),
            (2000, 7000),
            "file:///nonexistent/rotary/frag.raw".into(),
        )
        .await;
        let client = Client::connect(&addr).await.unwrap();
        let r = client.read_direct(&req(0, None), false);
        let stats = r.stats.clone();
        let (bytes, done) = collect(r).await;
        assert_eq!(bytes, j);
        assert_eq!((done.status, done.offset), (Status::OK, 10_000));
        assert_eq!(stats.fragments_proxied.load(Ordering::Relaxed), 1);
        let reads = seen.lock().unwrap().clone();
        assert_eq!(
            reads,
            vec![
                (Some(0), None, flag::DO_NOT_PROXY),
                (Some(2000), Some(7000), 0),
                (Some(7000), None, flag::DO_NOT_PROXY),
            ]
        );
    }

    #[tokio::test]
    async fn wrong_bytes_are_never_yielded() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal();
        let path = dir.path().join("frag.raw");
        let mut bad = j[2000..7000].to_vec();
        bad[10] ^= 0xff;
        std::fs::write(&path, &bad).unwrap();
        let (addr, _) = fake_broker(
            j.clone(),
            (2000, 7000),
            format!("file://{}", path.display()),
        )
        .await;
        let client = Client::connect(&addr).await.unwrap();
        let mut r = client.read_direct(&req(0, None), false);
        let mut got = Vec::new();
        let err = loop {
            match r.next().await.expect("an error ends the read") {
                Ok(ReadEvent::Data { content, .. }) => got.extend_from_slice(&content),
                Ok(other) => panic!("{other:?}"),
                Err(e) => break e,
            }
        };
        assert_eq!(
            got,
            j[..2000],
            "only the broker's bytes before the fragment"
        );
        assert!(
            matches!(err, ClientError::Fragment(FragmentError::Sha1 { .. })),
            "{err}"
        );
        assert!(!err.is_retryable());
        assert!(r.next().await.is_none());
    }
}
