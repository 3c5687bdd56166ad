//! Direct reads: history from the store, the rest from the broker.
//!
//! A [`DirectRead`] sends READ with DO_NOT_PROXY. Where the broker holds the
//! bytes it streams them as usual; where only a fragment store does, it
//! answers READ_FRAGMENT (the fragment's location) and READ_DONE at the
//! fragment's end. The reader then fetches the object itself
//! ([`super::fetch`]), checks it, yields its bytes from the requested
//! offset, and goes on from the fragment's end: one offset space across the
//! history → live handoff, with the broker out of the way of the bulk of the
//! bytes.
//!
//! The READ at the fragment's end goes out as soon as the fetch starts, not
//! when its bytes have been consumed: up to [`DIRECT_FETCHES_AHEAD_MAX`]
//! fetches run at once, each on a blocking-pool thread, so fetching and
//! checking the next fragments overlaps the reader's use of the current
//! one. Broker bytes that arrive behind a fetch wait for it; the order of
//! offsets is never changed.
//!
//! If the object cannot be fetched (the store is unreachable from this
//! client, a presigned URL expired, the fragment is too long to check in
//! memory) the same span is read through the broker instead. Bytes that do
//! not match the fragment's SHA-1 are never yielded: that ends the read
//! with [`ClientError::Fragment`].

use super::fetch::{fetch_fragment_into, FragmentError, FragmentRef};
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
    /// Fragments fetched into a buffer an earlier fragment of this read
    /// had used (no fresh memory mapped for them).
    pub buffers_reused: AtomicU64,
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
    /// Next offset to ask the broker for (past every fetch in `ahead`);
    /// `None` (the write head) only before the first READ.
    offset: Option<u64>,
    end_offset: Option<u64>,
    block: bool,
    /// The broker read in flight.
    stream: Option<ReadStream>,
    /// A READ_FRAGMENT of the read in flight, awaiting its READ_DONE.
    fragment: Option<(FragmentRef, u64)>,
    /// Reading through the broker up to this offset: the store was unreachable.
    proxy_until: Option<u64>,
    /// Fragments being fetched, in offset order: their bytes come next.
    ahead: VecDeque<Fetch>,
    /// Broker events that arrived while fetches were still ahead of them.
    held: VecDeque<ReadEvent>,
    /// No more READs: the broker's last READ_DONE is in `held` or `queued`,
    /// or will be queued behind the last fetch.
    broker_done: bool,
    /// Events ready to hand out (the checked bytes of a fetched fragment).
    queued: VecDeque<ReadEvent>,
    finished: bool,
    stats: Arc<DirectReadStats>,
    buffers: Arc<BufferPool>,
    /// While the journal's route moves (a broker died or hands its
    /// journals off), broker reads that fail are sent again from `offset`
    /// for up to [`crate::client::ClientOptions::retry_for`] from the
    /// first failure since the read last made progress.
    retry: Retry,
}

/// The retries of a read's broker reads.
struct Retry {
    /// When the tries since the last progress stop; `None` while the read
    /// goes well.
    give_up: Option<tokio::time::Instant>,
    pause: std::time::Duration,
    /// Broker reads that were tries again, not new spans.
    again: u64,
}

/// Fragment buffers a direct read has handed out and got back: a fetch
/// reuses one instead of mapping (and later unmapping) fresh memory, which
/// costs page faults and takes the process's memory-map lock that every
/// thread of the process needs.
#[derive(Default)]
struct BufferPool {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// Buffers a pool keeps; more are freed.
const POOLED_BUFFERS_MAX: usize = DIRECT_FETCHES_AHEAD_MAX + 2;
/// Larger buffers are freed rather than kept.
const POOLED_BUFFER_BYTES_MAX: usize = 256 << 20;

impl BufferPool {
    fn take(&self) -> Vec<u8> {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default()
    }
}

/// A fetched fragment's bytes; back to the pool when the last piece of it
/// handed out is dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < POOLED_BUFFERS_MAX && self.buf.capacity() <= POOLED_BUFFER_BYTES_MAX {
            free.push(std::mem::take(&mut self.buf));
        }
    }
}

/// A fragment fetch running on the blocking pool.
struct Fetch {
    fragment: FragmentRef,
    /// First offset of the fragment the read wants.
    from: u64,
    /// The write head the broker reported with the fragment's location.
    write_head: u64,
    task: tokio::task::JoinHandle<Result<Vec<u8>, FragmentError>>,
}

/// Fetches a direct read keeps running ahead of the bytes it hands out:
/// while one fragment is consumed the next ones are fetched and checked,
/// each on a blocking-pool thread of its own.
pub const DIRECT_FETCHES_AHEAD_MAX: usize = 3;
/// Bytes of fragments fetched ahead beyond the first are bounded by this.
pub const DIRECT_AHEAD_BYTES_MAX: u64 = 256 << 20;

impl DirectRead {
    pub(crate) fn new(client: Client, req: &ReadRequest, block: bool) -> DirectRead {
        let stats = Arc::new(DirectReadStats::default());
        DirectRead {
            state: Some(Box::new(State {
                journal: req.journal.clone(),
                offset: req.offset,
                end_offset: req.end_offset,
                block,
                stream: None,
                fragment: None,
                proxy_until: None,
                ahead: VecDeque::new(),
                held: VecDeque::new(),
                broker_done: false,
                queued: VecDeque::new(),
                finished: false,
                stats: stats.clone(),
                buffers: Arc::default(),
                retry: Retry {
                    give_up: None,
                    pause: crate::client::RETRY_PAUSE_MIN,
                    again: 0,
                },
                client,
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

impl Drop for State {
    fn drop(&mut self) {
        self.abort_ahead();
    }
}

/// What the next step of a direct read waits for.
enum Wake {
    Fetched(Result<Result<Vec<u8>, FragmentError>, tokio::task::JoinError>),
    Broker(Option<Result<ReadEvent, ClientError>>),
}

/// What a direct read does after taking in an event from the broker.
enum Taken {
    /// Go on waiting.
    Again,
    /// Answer this.
    Yield(Option<Result<ReadEvent, ClientError>>),
}

impl State {
    /// Whether a broker read that failed with `e` is to be sent again:
    /// the route is moving and the read's time to retry is not up. Waits
    /// out the pause before the next try.
    #[allow(clippy::disallowed_methods)] // The retry window is a tokio timer's, on tokio's clock.
    async fn try_again(&mut self, e: &ClientError) -> bool {
        let pause = self.retry.pause;
        let now = tokio::time::Instant::now();
        let give_up = *self
            .retry
            .give_up
            .get_or_insert(now + self.client.inner.options.retry_for);
        if !crate::client::is_failover(e) || now + pause >= give_up {
            return false;
        }
        self.stream = None;
        self.fragment = None;
        self.client.forget_route(&self.journal);
        tokio::time::sleep(pause).await;
        self.retry.pause = (pause * 2).min(crate::client::RETRY_PAUSE_MAX);
        self.retry.again += 1;
        true
    }

    fn fail(&mut self, e: ClientError) -> Option<Result<ReadEvent, ClientError>> {
        self.finished = true;
        self.stream = None;
        self.abort_ahead();
        Some(Err(e))
    }

    fn abort_ahead(&mut self) {
        for f in self.ahead.drain(..) {
            f.task.abort();
        }
    }

    fn protocol(&self, source: ProtocolError) -> ClientError {
        ClientError::Protocol {
            endpoint: self.client.endpoint().to_string(),
            source,
        }
    }

    /// Whether another broker event may be taken now: nothing from the
    /// broker is waiting behind the fetches, and they are not too far ahead.
    fn may_pull(&self) -> bool {
        if self.broker_done || !self.held.is_empty() {
            return false;
        }
        let ahead_bytes: u64 = self
            .ahead
            .iter()
            .skip(1)
            .map(|f| f.fragment.end - f.fragment.begin)
            .sum();
        self.ahead.len() < DIRECT_FETCHES_AHEAD_MAX && ahead_bytes < DIRECT_AHEAD_BYTES_MAX
    }

    async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        loop {
            if let Some(out) = self.ready() {
                return out;
            }
            let pull = self.may_pull();
            if pull && self.stream.is_none() {
                match self.start().await {
                    Ok(s) => self.stream = Some(s),
                    Err(e) if self.try_again(&e).await => continue,
                    Err(e) => return self.fail(e),
                }
            }
            let ev = match self.wake(pull).await {
                Wake::Fetched(r) => {
                    let fetch = self.ahead.pop_front().expect("polled above");
                    if let Err(e) = self.on_fetched(fetch, r) {
                        return self.fail(e);
                    }
                    continue;
                }
                Wake::Broker(Some(Ok(ev))) => ev,
                Wake::Broker(Some(Err(e))) if self.try_again(&e).await => continue,
                Wake::Broker(Some(Err(e))) => return self.fail(e),
                Wake::Broker(None) => return self.fail(self.protocol(ProtocolError::Truncated)),
            };
            if let Taken::Yield(out) = self.on_event(ev).await {
                return out;
            }
        }
    }

    /// What [`Self::next`] answers without waiting, if anything: an event
    /// queued or held back behind fetches that have all landed, or the end.
    fn ready(&mut self) -> Option<Option<Result<ReadEvent, ClientError>>> {
        if let Some(ev) = self.queued.pop_front() {
            return Some(Some(Ok(ev)));
        }
        if self.finished {
            return Some(None);
        }
        if self.ahead.is_empty() {
            if let Some(ev) = self.held.pop_front() {
                if let ReadEvent::Done(_) = ev {
                    self.finished = true;
                }
                return Some(Some(Ok(ev)));
            }
            if self.broker_done {
                self.finished = true;
                return Some(None);
            }
        }
        None
    }

    /// Waits for the first fetch ahead to land or, if `pull`, for the
    /// broker's next event, whichever comes first.
    async fn wake(&mut self, pull: bool) -> Wake {
        match (self.ahead.front_mut(), pull) {
            (Some(front), false) => Wake::Fetched((&mut front.task).await),
            (Some(front), true) => {
                let stream = self.stream.as_mut().expect("started above");
                // The broker first: its answers are small and each may
                // start another fetch.
                tokio::select! {
                    biased;
                    ev = stream.next() => Wake::Broker(ev),
                    r = &mut front.task => Wake::Fetched(r),
                }
            }
            (None, _) => {
                let stream = self.stream.as_mut().expect("started above");
                Wake::Broker(stream.next().await)
            }
        }
    }

    /// Takes in an event from the broker: data passed on (or held behind
    /// fetches ahead of it), a fragment to fetch, or the read's end.
    async fn on_event(&mut self, ev: ReadEvent) -> Taken {
        match ev {
            ReadEvent::Data { offset, content } => {
                self.offset = Some(offset + content.len() as u64);
                self.retry.give_up = None;
                self.retry.pause = crate::client::RETRY_PAUSE_MIN;
                let ev = ReadEvent::Data { offset, content };
                if self.ahead.is_empty() {
                    return Taken::Yield(Some(Ok(ev)));
                }
                self.held.push_back(ev);
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
                    return Taken::Yield(self.fail(self.protocol(ProtocolError::UnexpectedOp {
                        request: crate::wire::Op::READ,
                        got: crate::wire::Op::READ_FRAGMENT,
                    })));
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
                self.client
                    .saw_route_revision(&self.journal, done.route_revision);
                if let Err(e) = done.check() {
                    if done.status != Status::OFFSET_NOT_YET_AVAILABLE && self.try_again(&e).await {
                        return Taken::Again;
                    }
                }
                let reads = self.stats.reads.load(Ordering::Relaxed);
                let first_read = reads - self.retry.again == 1;
                if let Some(done) = self.on_done(done, first_read) {
                    if self.ahead.is_empty() {
                        self.finished = true;
                        return Taken::Yield(Some(Ok(done)));
                    }
                    self.held.push_back(done);
                }
            }
        }
        Taken::Again
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
            route_revision: 0,
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

    /// A READ ended. Returns the READ_DONE that ends the whole read, or
    /// `None` to go on: with another READ, or behind a fragment fetch.
    fn on_done(&mut self, done: ReadDone, first_read: bool) -> Option<ReadEvent> {
        if done.status != Status::OK {
            self.fragment = None;
            self.broker_done = true;
            // Once bytes were handed out, the read as a whole started below
            // the head: reaching the head is its normal end, as it is for a
            // single broker read.
            if done.status == Status::OFFSET_NOT_YET_AVAILABLE && !first_read && !self.block {
                return Some(ReadEvent::Done(ReadDone {
                    status: Status::OK,
                    message: String::new(),
                    ..done
                }));
            }
            return Some(ReadEvent::Done(done));
        }
        if let Some((fragment, from)) = self.fragment.take() {
            // ReadStream checked begin <= from < end.
            let agent = self.client.http_agent();
            let f = fragment.clone();
            let buf = self.buffers.take();
            if buf.capacity() > 0 {
                self.stats.buffers_reused.fetch_add(1, Ordering::Relaxed);
            }
            let task = tokio::task::spawn_blocking(move || fetch_fragment_into(&agent, &f, buf));
            let to = self
                .end_offset
                .map_or(fragment.end, |e| e.min(fragment.end));
            self.offset = Some(to);
            // The fetch queues the read's READ_DONE if it ends there.
            self.broker_done = self.end_offset.is_some_and(|e| to >= e);
            self.ahead.push_back(Fetch {
                fragment,
                from,
                write_head: done.write_head,
                task,
            });
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
        self.broker_done = true;
        Some(ReadEvent::Done(done))
    }

    /// The fetch at the front finished: queue its bytes, or read its span
    /// through the broker if the store could not be reached.
    fn on_fetched(
        &mut self,
        fetch: Fetch,
        result: Result<Result<Vec<u8>, FragmentError>, tokio::task::JoinError>,
    ) -> Result<(), ClientError> {
        let Fetch {
            fragment,
            from,
            write_head,
            ..
        } = fetch;
        let fetched = result.map_err(|join| ClientError::Io {
            endpoint: fragment.location.clone(),
            source: Arc::new(std::io::Error::other(join.to_string())),
        })?;
        match fetched {
            Ok(bytes) => {
                self.stats.fragments_fetched.fetch_add(1, Ordering::Relaxed);
                let bytes = Bytes::from_owner(Pooled {
                    buf: bytes,
                    pool: self.buffers.clone(),
                });
                self.queue_fragment(&fragment, from, bytes, write_head);
                Ok(())
            }
            Err(e) if e.is_unreachable() => {
                // Everything read past this fragment is dropped and read
                // again once its span came through the broker.
                self.stats.fragments_proxied.fetch_add(1, Ordering::Relaxed);
                self.abort_ahead();
                self.held.clear();
                self.stream = None;
                self.fragment = None;
                self.broker_done = false;
                self.offset = Some(from);
                self.proxy_until = Some(fragment.end);
                Ok(())
            }
            Err(e) => Err(ClientError::Fragment(e)),
        }
    }

    /// Queues a checked fragment's bytes from `from` (up to the read's end
    /// offset) in READ_DATA-sized pieces, and the read's READ_DONE if it
    /// ends there.
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
        if self.end_offset.is_some_and(|e| to >= e) {
            self.queued.push_back(ReadEvent::Done(ReadDone {
                offset: to,
                write_head,
                status: Status::OK,
                message: String::new(),
                route_revision: 0,
            }));
            self.finished = true;
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
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use zerocopy::byteorder::little_endian::U64;
    use zerocopy::IntoBytes;

    /// A READ the fake broker received: (offset, end_offset, flags).
    type Seen = Arc<Mutex<Vec<(Option<u64>, Option<u64>, u8)>>>;

    /// A fake broker holding `journal` whose bytes `[store.0, store.1)` live
    /// only in a store at `location`; everything else it serves itself.
    async fn fake_broker(journal: Vec<u8>, store: (u64, u64), location: String) -> (String, Seen) {
        fake_broker_spans(journal, vec![(store.0, store.1, location)]).await
    }

    /// A fake broker holding `journal` whose bytes in each span
    /// `[begin, end)` live only in a store at its location.
    async fn fake_broker_spans(journal: Vec<u8>, spans: Vec<(u64, u64, String)>) -> (String, Seen) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen: Seen = Arc::default();
        let (endpoint, seen2) = (addr.clone(), seen.clone());
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut tmp = vec![0u8; 1 << 16];
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
                        let journal = wire::decode_name(f.meta).unwrap();
                        crate::client::fake_route_reply(&mut out, id, journal, &endpoint);
                    }
                    Op::READ => answer_read(&mut out, &f, &journal, &spans, &seen2),
                    Op::CANCEL => {}
                    other => panic!("unexpected {other:?}"),
                }
                sock.write_all(&out).await.unwrap();
                buf.drain(..used);
            }
        });
        (addr, seen)
    }

    /// The fake broker's answer to a READ: its own bytes up to the first
    /// store span (all of them when proxying), that span's location, and
    /// READ_DONE.
    fn answer_read(
        out: &mut Vec<u8>,
        f: &wire::Frame<'_>,
        journal: &[u8],
        spans: &[(u64, u64, String)],
        seen: &Seen,
    ) {
        let id = f.request_id;
        let head = journal.len() as u64;
        let req = ReadRequest::decode(f.meta).unwrap();
        seen.lock()
            .unwrap()
            .push((req.offset, req.end_offset, f.flags));
        let from = req.offset.unwrap_or(head);
        let end = req.end_offset.unwrap_or(head).min(head);
        let direct = f.flags & flag::DO_NOT_PROXY != 0;
        // The first store span at or past `from`.
        let span = spans.iter().find(|(_, e, _)| from < *e);
        let data_to = match span {
            Some((b, _, _)) if direct => (*b).max(from).min(end),
            _ => end,
        };
        let mut at = from;
        while at < data_to {
            let n = (data_to - at).min(1000);
            let meta = wire::ReadData {
                offset: U64::new(at),
            };
            wire::encode_frame(
                out,
                Op::READ_DATA,
                0,
                Status::OK,
                id,
                meta.as_bytes(),
                &journal[at as usize..(at + n) as usize],
            );
            at += n;
        }
        let store = span
            .filter(|(b, e, _)| direct && at >= *b && at < *e && at < end)
            .cloned();
        let (status, next) = if let Some((b, e, location)) = store {
            let meta = wire::ReadFragment {
                begin: U64::new(b),
                end: U64::new(e),
                offset: U64::new(at),
                sha1: Sha1::digest(&journal[b as usize..e as usize]).into(),
                codec: wire::codec_code(Codec::None),
                reserved: [0; 3],
            };
            wire::encode_frame(
                out,
                Op::READ_FRAGMENT,
                0,
                Status::OK,
                id,
                meta.as_bytes(),
                location.as_bytes(),
            );
            (Status::OK, e)
        } else if from >= head {
            (Status::OFFSET_NOT_YET_AVAILABLE, from)
        } else {
            (Status::OK, at)
        };
        let meta = wire::ReadDone {
            offset: U64::new(next),
            write_head: U64::new(head),
        };
        wire::encode_frame(out, Op::READ_DONE, 0, status, id, meta.as_bytes(), &[]);
    }

    /// A whole direct read from `offset` to the head through a fresh client,
    /// with the read's stats.
    async fn read_whole(addr: &str, offset: u64) -> (Vec<u8>, ReadDone, Arc<DirectReadStats>) {
        let client = Client::connect(addr).await.unwrap();
        let r = client.read_direct(&req(offset, None), false);
        let stats = r.stats.clone();
        let (bytes, done) = collect(r).await;
        (bytes, done, stats)
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
            route_revision: 0,
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
        let (bytes, done, stats) = read_whole(&addr, 0).await;
        assert_eq!(bytes, j);
        assert_eq!((done.status, done.offset), (Status::OK, 10_000));
        assert_eq!(stats.fragments_proxied.load(Ordering::Relaxed), 1);
        // The read past the fragment may have been sent while the fetch
        // was failing; it is sent again once the span came through the broker.
        let mut reads = seen.lock().unwrap().clone();
        if reads[1] == (Some(7000), None, flag::DO_NOT_PROXY) {
            reads.remove(1);
        }
        assert_eq!(
            reads,
            vec![
                (Some(0), None, flag::DO_NOT_PROXY),
                (Some(2000), Some(7000), 0),
                (Some(7000), None, flag::DO_NOT_PROXY),
            ]
        );
    }

    /// Three store fragments: `[1000, 3000)`, `[3000, 6000)`, `[6000, 8000)`,
    /// the middle one at `middle` (a path, or anything else).
    fn three_fragments(
        dir: &std::path::Path,
        j: &[u8],
        middle: Option<String>,
    ) -> Vec<(u64, u64, String)> {
        [(1000u64, 3000u64), (3000, 6000), (6000, 8000)]
            .into_iter()
            .enumerate()
            .map(|(i, (b, e))| {
                let path = dir.join(format!("frag-{i}.raw"));
                std::fs::write(&path, &j[b as usize..e as usize]).unwrap();
                let location = match (&middle, i) {
                    (Some(m), 1) => m.clone(),
                    _ => format!("file://{}", path.display()),
                };
                (b, e, location)
            })
            .collect()
    }

    #[tokio::test]
    async fn fetches_run_ahead_of_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal();
        let spans = three_fragments(dir.path(), &j, None);
        let (addr, seen) = fake_broker_spans(j.clone(), spans).await;
        let client = Client::connect(&addr).await.unwrap();
        let mut r = client.read_direct(&req(0, None), false);

        // Take the bytes up to the second fragment's first piece, then stop
        // asking. The read for the third fragment went out before the second
        // fragment's fetch was awaited, so it reaches the broker anyway.
        let mut got = Vec::new();
        while got.len() < 3001 {
            match r.next().await.unwrap().unwrap() {
                ReadEvent::Data { offset, content } => {
                    assert_eq!(offset, got.len() as u64);
                    got.extend_from_slice(&content);
                }
                other => panic!("{other:?}"),
            }
        }
        let mut waited = 0;
        while seen.lock().unwrap().len() < 3 {
            assert!(
                waited < 500,
                "reads never ran ahead: {:?}",
                seen.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
        }
        assert_eq!(
            seen.lock().unwrap()[..3],
            [
                (Some(0), None, flag::DO_NOT_PROXY),
                (Some(3000), None, flag::DO_NOT_PROXY),
                (Some(6000), None, flag::DO_NOT_PROXY),
            ]
        );
        let stats = r.stats.clone();
        let (rest, done) = collect(r).await;
        got.extend_from_slice(&rest);
        assert_eq!(got, j);
        assert_eq!((done.status, done.offset), (Status::OK, 10_000));
        assert_eq!(stats.fragments_fetched.load(Ordering::Relaxed), 3);

        // Ending inside the second fragment: no read past it.
        seen.lock().unwrap().clear();
        let (bytes, done) = collect(client.read_direct(&req(500, Some(4000)), false)).await;
        assert_eq!(bytes, j[500..4000]);
        assert_eq!((done.status, done.offset), (Status::OK, 4000));
        assert!(seen
            .lock()
            .unwrap()
            .iter()
            .all(|(o, _, _)| o.unwrap() < 4000));
    }

    #[tokio::test]
    async fn fragment_buffers_are_reused_once_their_bytes_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal();
        let spans: Vec<(u64, u64, String)> = (0..10u64)
            .map(|i| {
                let (b, e) = (i * 1000, (i + 1) * 1000);
                let path = dir.path().join(format!("frag-{i}.raw"));
                std::fs::write(&path, &j[b as usize..e as usize]).unwrap();
                (b, e, format!("file://{}", path.display()))
            })
            .collect();
        let (addr, _) = fake_broker_spans(j.clone(), spans).await;
        // `collect` copies each piece and drops it.
        let (bytes, done, stats) = read_whole(&addr, 0).await;
        assert_eq!(bytes, j);
        assert_eq!((done.status, done.offset), (Status::OK, 10_000));
        assert_eq!(stats.fragments_fetched.load(Ordering::Relaxed), 10);
        let reused = stats.buffers_reused.load(Ordering::Relaxed);
        assert!(reused >= 1, "no buffer was reused");
        assert!(
            reused < 10,
            "the first fetch has nothing to reuse: {reused}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_fragment_between_fetched_ones_is_read_through_the_broker() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal();
        let spans = three_fragments(
            dir.path(),
            &j,
            Some("file:///nonexistent/rotary/frag.raw".into()),
        );
        let (addr, seen) = fake_broker_spans(j.clone(), spans).await;
        let (bytes, done, stats) = read_whole(&addr, 0).await;
        assert_eq!(bytes, j);
        assert_eq!((done.status, done.offset), (Status::OK, 10_000));
        assert_eq!(stats.fragments_fetched.load(Ordering::Relaxed), 2);
        assert_eq!(stats.fragments_proxied.load(Ordering::Relaxed), 1);
        let seen = seen.lock().unwrap();
        assert!(seen.contains(&(Some(3000), Some(6000), 0)), "{seen:?}");
        assert_eq!(seen.last(), Some(&(Some(8000), None, flag::DO_NOT_PROXY)));
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
