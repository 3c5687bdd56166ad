//! One client connection on a shard: decodes frames, dispatches requests
//! to the shard, forwards requests for journals of other shards, and
//! answers every malformed request with a status.

mod admin;
mod append;
mod etcd;
mod read;
mod relay;
mod replica;

use crate::append::{AbortReason, AckSink, AppendOp, Chunk, Proposal, SyncWaiter};
use crate::budget::{
    Budget, CONN_APPEND_QUEUE_BYTES_MAX, CONN_DISCARDS_MAX, CONN_OPEN_APPENDS_MAX,
    CONN_OPEN_READS_MAX, CONN_REPLICATED_APPENDS_MAX,
};
use crate::metrics;
use crate::outbox::{self, Outbox, OUTBOX_REQUESTS_PAUSE_BYTES};
use crate::replica::Verdict;
use crate::shard::{Cancel, ReadAsk, Role};
use crate::shard::{JournalRef, Shard};
use compio::buf::{BufResult, IntoInner, IoBuf, IoBufMut};
use compio::io::AsyncRead;
use compio::net::TcpStream;
use relay::{Relay, FORWARDED_READS_PRUNE_AT};
use rotary_net::repl;
use rotary_net::spec::{validate_journal_name, JournalFlags, JournalSpec, LabelSelector};
use rotary_net::status::Status;
use rotary_net::wire::{
    self, flag, AppendReply, AppendRequest, Frame, Op, ReadRequest, BODY_LEN_MAX, HEADER_LEN,
};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Frames at least this large are read into their own buffer, which then
/// becomes the append's chunk without a copy.
const LARGE_FRAME_BYTES: usize = 128 << 10;
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Default of `rotary serve --peer-silence` (`ServeConfig::peer_silence`).
pub const PEER_SILENCE_DEFAULT: Duration = Duration::from_secs(15);
/// How long connecting to another shard or broker, to forward or proxy a
/// request, may take before the request is answered `IO_ERROR`.
pub const RELAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalive of client connections (and of the relays a broker opens
/// to forward or proxy their requests): first probe after this long
/// without traffic, then probes this far apart, this many unanswered
/// before the kernel resets the connection: a client gone without a
/// reset is found within about 90 s.
pub const CLIENT_KEEPALIVE: (Duration, Duration, u32) =
    (Duration::from_secs(60), Duration::from_secs(10), 3);

struct Conn {
    shard: Rc<Shard>,
    outbox: Rc<Outbox>,
    budget: Rc<Budget>,
    /// Streamed appends awaiting chunks, by request id.
    appends: HashMap<u64, (Rc<AppendOp>, JournalRef)>,
    /// Request ids whose remaining chunks are dropped (refused early).
    discard: HashSet<u64>,
    reads: Rc<RefCell<HashMap<u64, Rc<Cancel>>>>,
    /// Streamed appends forwarded to another shard or broker, by request
    /// id, until their last chunk.
    forwarded: HashMap<u64, SocketAddr>,
    /// Reads forwarded to another shard or broker, by request id (for
    /// CANCEL). Those answered whole are dropped now and then.
    forwarded_reads: HashMap<u64, SocketAddr>,
    /// `forwarded_reads` is pruned when it grows to this many.
    forwarded_reads_prune_at: usize,
    /// Connections to other shards and brokers, by endpoint.
    relays: HashMap<SocketAddr, Relay>,
    /// Replicated appends open on this connection (it comes from a
    /// primary), by the primary's sequence number.
    repl_ops: HashMap<u64, (Rc<AppendOp>, JournalRef)>,
    /// Of `repl_ops`, each journal's newest (by the journal's address):
    /// the one whose content may still grow. A new one's start ends it.
    repl_newest: HashMap<usize, Rc<AppendOp>>,
    /// Where this connection's replica acks gather.
    sink: Option<Rc<AckSink>>,
    /// Set when the client ran past a limit that leaves no answer but
    /// closing: the connection is closed with this message once the frame
    /// in hand is handled.
    overrun: Option<String>,
}

pub async fn serve(shard: Rc<Shard>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    keep_alive(&stream);
    metrics::add(&shard.metrics.connections, 1);
    let (rd, wr) = stream.into_split();
    let outbox = Rc::new(Outbox::new());
    shard.add_outbox(&outbox);
    compio::runtime::spawn(outbox::writer(wr, outbox.clone())).detach();
    let budget = Rc::new(Budget::new(shard.append_queue.clone()));
    let mut conn = Conn {
        shard,
        outbox,
        budget,
        appends: HashMap::new(),
        discard: HashSet::new(),
        reads: Rc::new(RefCell::new(HashMap::new())),
        forwarded: HashMap::new(),
        forwarded_reads: HashMap::new(),
        forwarded_reads_prune_at: FORWARDED_READS_PRUNE_AT,
        relays: HashMap::new(),
        repl_ops: HashMap::new(),
        repl_newest: HashMap::new(),
        sink: None,
        overrun: None,
    };
    conn.run(rd).await;
    conn.close();
}

/// Request id of a frame whose header is readable, else 0.
fn header_request_id(bytes: &[u8]) -> u64 {
    use zerocopy::FromBytes;
    wire::FrameHeader::read_from_prefix(bytes).map_or(0, |(h, _)| h.request_id.get())
}

impl Conn {
    async fn run(&mut self, mut rd: TcpStream) {
        let mut buf: Vec<u8> = Vec::with_capacity(READ_BUFFER_BYTES);
        // Bytes of a refused frame still to be skipped.
        let mut skip = 0usize;
        loop {
            // Decode and handle every whole frame in the buffer.
            let mut start = 0;
            loop {
                if skip > 0 {
                    let n = skip.min(buf.len() - start);
                    start += n;
                    skip -= n;
                    if skip > 0 {
                        break;
                    }
                }
                let avail = &buf[start..];
                let total = match wire::decode_header(avail, BODY_LEN_MAX) {
                    Err(e) => {
                        let id = header_request_id(avail);
                        self.outbox
                            .error(Op::ERROR, e.status(), id, &[], &e.to_string());
                        match e {
                            // The frame's length is trustworthy: skip it.
                            wire::WireError::MetaTooLong { body_len, .. } => {
                                skip = HEADER_LEN + body_len as usize
                            }
                            wire::WireError::UnknownFlags { .. } | wire::WireError::Reserved => {
                                use zerocopy::FromBytes;
                                let (header, _) = wire::FrameHeader::read_from_prefix(avail)
                                    .expect("a whole header");
                                skip = HEADER_LEN + header.body_len.get() as usize;
                            }
                            // Bad magic, oversized, unknown op: close.
                            _ => return,
                        }
                        continue;
                    }
                    Ok(None) => break,
                    Ok(Some((_, total))) => total,
                };
                if avail.len() >= total {
                    let (frame, _) = wire::decode_frame(avail, BODY_LEN_MAX)
                        .expect("header checked")
                        .expect("whole frame");
                    // New requests wait while their replies would pile up
                    // (chunks of an open append and cancels go on).
                    if !matches!(frame.op, Op::APPEND_CHUNK | Op::CANCEL) {
                        self.outbox.below(OUTBOX_REQUESTS_PAUSE_BYTES).await;
                    }
                    if !self.handle(frame, Body::Borrowed(&avail[..total])).await {
                        return;
                    }
                    start += total;
                    continue;
                }
                if total >= LARGE_FRAME_BYTES {
                    let keep = self.handle_large(&mut rd, avail, total).await;
                    start = buf.len();
                    if !keep {
                        return;
                    }
                }
                break;
            }
            buf.drain(..start);
            if buf.capacity() - buf.len() < READ_BUFFER_BYTES / 4 {
                buf.reserve(READ_BUFFER_BYTES);
            }
            // A primary's replication stream is not held back by the
            // shard's budget: that would hold back every journal it
            // carries, and the primary bounds what it sends.
            self.budget
                .below(CONN_APPEND_QUEUE_BYTES_MAX, self.sink.is_none())
                .await;
            let BufResult(res, b) = rd.read(buf.uninit()).await;
            buf = b.into_inner();
            match res {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// Reads the rest of a large frame (`total` bytes, of which `avail`
    /// arrived) into a buffer of its own, which becomes the append's chunk
    /// without a copy, and handles it. False closes the connection.
    async fn handle_large(&mut self, rd: &mut TcpStream, avail: &[u8], total: usize) -> bool {
        // Read the rest of this frame into a buffer of its own.
        let mut big = Vec::with_capacity(total);
        big.extend_from_slice(avail);
        while big.len() < total {
            let at = big.len();
            let BufResult(res, b) = rd.read(big.slice(at..total)).await;
            big = b.into_inner();
            match res {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        let (frame, _) = wire::decode_frame(&big, BODY_LEN_MAX)
            .expect("header checked")
            .expect("whole frame");
        let payload_at = HEADER_LEN + frame.meta.len();
        // The frame's metadata is copied out (it is small) so the
        // buffer itself can move into the append as its chunk.
        let head = big[..payload_at].to_vec();
        let frame = Frame {
            meta: &head[HEADER_LEN..],
            payload: &[],
            ..frame
        };
        self.handle(
            frame,
            Body::Owned(Chunk {
                data: Arc::new(big),
                range: payload_at..total,
            }),
        )
        .await
    }

    /// Handles one frame; false closes the connection, with an `ERROR`
    /// frame first if the client ran past a limit.
    async fn handle(&mut self, frame: Frame<'_>, body: Body<'_>) -> bool {
        let keep = self.dispatch(frame, body).await;
        match self.overrun.take() {
            Some(msg) => {
                self.outbox
                    .error(Op::ERROR, Status::TOO_MANY_REQUESTS, 0, &[], &msg);
                false
            }
            None => keep,
        }
    }

    /// Remembers to drop the remaining chunks of refused streamed append
    /// `id`, unless the connection already drops [`CONN_DISCARDS_MAX`]
    /// appends' chunks: then it is to be closed.
    fn discard_rest(&mut self, id: u64) {
        if self.discard.len() >= CONN_DISCARDS_MAX && !self.discard.contains(&id) {
            self.overrun = Some(format!(
                "the connection left {CONN_DISCARDS_MAX} refused streamed appends unfinished; it is closed"
            ));
            return;
        }
        self.discard.insert(id);
    }

    /// Handles one frame; false closes the connection.
    async fn dispatch(&mut self, frame: Frame<'_>, body: Body<'_>) -> bool {
        let id = frame.request_id;
        // A large frame comes in a buffer of its own, and its payload with
        // it, not in `frame` (see the read loop).
        let payload = body.payload(&frame);
        let misshapen = shape_error(frame.op, frame.meta.len(), payload.len());
        if frame.op == Op::APPEND_CHUNK {
            self.append_chunk(frame, body, misshapen);
            return true;
        }
        if let Some((status, msg)) = misshapen {
            self.refuse_shape(&frame, status, &msg);
            return true;
        }
        match frame.op {
            Op::APPEND => self.append(frame, body).await,
            Op::READ => self.read(frame, body.raw()).await,
            Op::CANCEL => {
                if let Some(&addr) = self.forwarded_reads.get(&id) {
                    self.forward_to(addr, body.raw()).await;
                } else if let Some(c) = self.reads.borrow().get(&id) {
                    c.cancel();
                }
            }
            Op::PING => self.outbox.frame(Op::PONG, Status::OK, id, &[], payload),
            Op::ROUTE => self.route(id, frame.meta).await,
            Op::REPLICATE => {
                let own = match &body {
                    Body::Owned(c) => Some(c.data.clone()),
                    Body::Borrowed(_) => None,
                };
                return self.replicate(payload, own.as_ref());
            }
            Op::SYNC => self.sync(frame.request_id, payload).await,
            Op::APPLY => self.apply(id, payload).await,
            Op::MEMBERS => self.members(id).await,
            Op::DRAIN => self.drain_member(id, payload).await,
            Op::LIST => self.list(id, payload),
            Op::STATS => {
                let mut body = self.shard.metrics.to_json(self.shard.shards as usize);
                let m = self.shard.uploader.metrics();
                let load =
                    |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
                body["upload_queue_depth"] = load(&m.queued).into();
                body["uploads"] = load(&m.uploads).into();
                body["upload_failures"] = load(&m.upload_failures).into();
                body["upload_bytes"] = load(&m.upload_bytes).into();
                body["upload_stored_bytes"] = load(&m.upload_stored_bytes).into();
                body["upload_micros_total"] = load(&m.upload_micros).into();
                let (specs, digest) = self.shard.specs.digest();
                body["specs"] = specs.into();
                body["specs_digest"] = format!("{digest:032x}").into();
                let views = self.shard.views();
                if !views.current.is_single() {
                    body["cluster_views"] = serde_json::json!(views.known());
                }
                self.admin_ok(id, &body);
            }
            Op::PRUNE => self.prune(id, payload).await,
            Op::DELETE | Op::FRAGMENTS | Op::SEAL | Op::RESET_HEAD => {
                self.by_name(Frame { payload, ..frame }, body.raw()).await
            }
            _ => {
                self.outbox.error(
                    Op::ERROR,
                    Status::BAD_REQUEST,
                    id,
                    &[],
                    &format!("{:?} is not a request", frame.op),
                );
            }
        }
        true
    }

    /// Answers a request whose meta or payload §4 does not allow, in the
    /// request's own reply op (chunks: see [`Conn::append_chunk`]).
    fn refuse_shape(&mut self, frame: &Frame<'_>, status: Status, msg: &str) {
        let id = frame.request_id;
        match frame.op {
            Op::APPEND => self.refuse_append(frame, status, msg),
            Op::READ => self.outbox.error(Op::READ_DONE, status, id, &[0; 16], msg),
            Op::PING => self.outbox.error(Op::ERROR, status, id, &[], msg),
            _ => self.admin_err(id, status, msg),
        }
    }

    fn close(&mut self) {
        self.repl_newest.clear();
        for (_, (op, j)) in self.appends.drain().chain(self.repl_ops.drain()) {
            op.aborted.set(Some(AbortReason::Closed));
            self.shard.mark_ready(&j);
        }
        for c in self.reads.borrow().values() {
            c.cancel();
        }
        for r in self.relays.values() {
            r.out.close();
        }
        self.outbox.close();
    }
}

/// A frame's bytes: still in the connection's read buffer, or in a buffer
/// of its own that can become an append chunk without a copy.
enum Body<'a> {
    Borrowed(&'a [u8]),
    /// The whole frame; `range` is its payload.
    Owned(Chunk),
}

impl Body<'_> {
    /// The whole frame, for forwarding.
    fn raw(&self) -> &[u8] {
        match self {
            Body::Borrowed(raw) => raw,
            Body::Owned(c) => &c.data,
        }
    }

    fn payload<'f>(&'f self, frame: &'f Frame<'_>) -> &'f [u8] {
        match self {
            Body::Borrowed(_) => frame.payload,
            Body::Owned(c) => c.bytes(),
        }
    }
}

/// What is wrong with a request's meta or payload, by the shapes of
/// PROTOCOL.md §4: payloads above [`wire::PAYLOAD_LEN_MAX`] are
/// `FRAME_TOO_LARGE`, and meta or payload where the op has none is
/// `BAD_REQUEST`. Frames between brokers (REPLICATE, SYNC) and CANCEL,
/// which has no reply of its own, are not checked here; ops that are not
/// requests are refused by the dispatch.
fn shape_error(op: Op, meta_len: usize, payload_len: usize) -> Option<(Status, String)> {
    if matches!(op, Op::REPLICATE | Op::SYNC | Op::CANCEL) {
        return None;
    }
    if payload_len > wire::PAYLOAD_LEN_MAX {
        return Some((
            Status::FRAME_TOO_LARGE,
            format!(
                "{op:?} payload of {payload_len} bytes; at most {} (send content in several APPEND_CHUNK frames)",
                wire::PAYLOAD_LEN_MAX
            ),
        ));
    }
    let no_meta = matches!(
        op,
        Op::APPEND_CHUNK
            | Op::APPLY
            | Op::LIST
            | Op::STATS
            | Op::PING
            | Op::PRUNE
            | Op::MEMBERS
            | Op::DRAIN
    );
    if no_meta && meta_len != 0 {
        return Some((
            Status::BAD_REQUEST,
            format!("{op:?} carries no meta; this one has {meta_len} bytes"),
        ));
    }
    let no_payload = matches!(
        op,
        Op::READ | Op::ROUTE | Op::SEAL | Op::STATS | Op::RESET_HEAD | Op::MEMBERS
    );
    if no_payload && payload_len != 0 {
        return Some((
            Status::BAD_REQUEST,
            format!("{op:?} carries no payload; this one has {payload_len} bytes"),
        ));
    }
    None
}

/// A copy of a frame with the bits `set` added to its header's flags and
/// the bits `clear` taken out.
fn with_flags(raw: &[u8], set: u8, clear: u8) -> Vec<u8> {
    let mut v = raw.to_vec();
    // Header: body_len u32, magic u16, op u8, flags u8, …
    v[7] = (v[7] | set) & !clear;
    v
}

/// Turns on [`CLIENT_KEEPALIVE`] for a connection; a socket that refuses
/// it is served without.
fn keep_alive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let (idle, interval, count) = CLIENT_KEEPALIVE;
    let _ = crate::sys::keep_alive(stream.as_raw_fd(), idle, interval, count);
}
