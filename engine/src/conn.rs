//! One client connection on a shard: decodes frames, dispatches requests
//! to the shard, forwards requests for journals of other shards, and
//! answers every malformed request with a status.

use crate::cluster::control::{ControlError, ControlHandle};
use crate::journal::{AbortReason, AckSink, AppendOp, Chunk, Proposal, ReplicaOp, SyncWaiter};
use crate::metrics;
use crate::outbox::{self, Outbox, OUTBOX_REQUESTS_PAUSE_BYTES};
use crate::replica::Verdict;
use crate::shard::Role;
use crate::shard::{JournalRef, Shard};
use compio::buf::{BufResult, IntoInner, IoBuf, IoBufMut};
use compio::io::AsyncRead;
use compio::net::TcpStream;
use event_listener::Event;
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

/// Append bytes a connection may have queued before the broker stops
/// reading from it.
pub const CONN_APPEND_QUEUE_BYTES_MAX: usize = 64 << 20;
/// Frames at least this large are read into their own buffer, which then
/// becomes the append's chunk without a copy.
const LARGE_FRAME_BYTES: usize = 128 << 10;
const READ_BUFFER_BYTES: usize = 256 << 10;

/// A connection holding at least this much queued append content stops
/// reading while its shard's [`QueueBudget`] is spent. Below it, it reads
/// on: it may be streaming the append its journal waits for.
pub const CONN_APPEND_QUEUE_BYTES_FREE: usize = 1 << 20;
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

/// Append bytes queued by all connections of one shard and not yet staged,
/// against the shard's share of `--append-queue-budget`.
pub struct QueueBudget {
    used: Cell<usize>,
    limit: usize,
    event: Event,
    /// Broker-wide gauges and counters (`append_queued_bytes`,
    /// `append_queue_waits`), if this budget reports to them.
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl QueueBudget {
    pub fn new(limit: usize, metrics: Option<Arc<crate::metrics::Metrics>>) -> Self {
        QueueBudget {
            used: Cell::new(0),
            limit,
            event: Event::new(),
            metrics,
        }
    }

    fn spent(&self) -> bool {
        self.used.get() >= self.limit
    }
}

/// Append bytes queued by a connection and not yet staged.
pub struct Budget {
    used: Cell<usize>,
    event: Event,
    shard: Rc<QueueBudget>,
    /// Appends of this connection that hold their journal (see
    /// [`Streaming`]): the connection is read on for them.
    streaming: Cell<usize>,
}

/// Held by an append while it holds its journal: its connection is not
/// held back by the shard's budget, since the rest of its content, which
/// the journal waits for, arrives only by reading it.
pub struct Streaming(Rc<Budget>);

impl Streaming {
    pub fn new(budget: Rc<Budget>) -> Self {
        budget.streaming.set(budget.streaming.get() + 1);
        budget.shard.event.notify(usize::MAX);
        Streaming(budget)
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        let b = &self.0;
        b.streaming.set(b.streaming.get().saturating_sub(1));
    }
}

impl Default for Budget {
    /// A budget of its own, bound by no shard's.
    fn default() -> Self {
        Budget::new(Rc::new(QueueBudget::new(usize::MAX, None)))
    }
}

impl Budget {
    pub fn new(shard: Rc<QueueBudget>) -> Self {
        Budget {
            used: Cell::new(0),
            event: Event::new(),
            shard,
            streaming: Cell::new(0),
        }
    }

    pub fn charge(&self, n: usize) {
        self.used.set(self.used.get() + n);
        self.shard.used.set(self.shard.used.get() + n);
        if let Some(m) = &self.shard.metrics {
            metrics::add(&m.append_queued_bytes, n as u64);
        }
    }

    pub fn release(&self, n: usize) {
        let n = n.min(self.used.get());
        self.used.set(self.used.get() - n);
        self.shard.used.set(self.shard.used.get().saturating_sub(n));
        if let Some(m) = &self.shard.metrics {
            metrics::sub(&m.append_queued_bytes, n as u64);
        }
        self.event.notify(usize::MAX);
        self.shard.event.notify(usize::MAX);
    }

    /// Waits until this connection may read more: it holds less than
    /// `limit` queued, and, if `shared`, less than
    /// [`CONN_APPEND_QUEUE_BYTES_FREE`], or an append of it holds its
    /// journal, or the shard's budget is not spent.
    async fn below(&self, limit: usize, shared: bool) {
        let mut counted = false;
        loop {
            if self.used.get() >= limit {
                let l = self.event.listen();
                if self.used.get() >= limit {
                    l.await;
                }
                continue;
            }
            let gated = || {
                shared
                    && self.used.get() >= CONN_APPEND_QUEUE_BYTES_FREE
                    && self.streaming.get() == 0
                    && self.shard.spent()
            };
            if !gated() {
                return;
            }
            if !counted {
                counted = true;
                if let Some(m) = &self.shard.metrics {
                    metrics::add(&m.append_queue_waits, 1);
                }
            }
            let l = self.shard.event.listen();
            if gated() {
                l.await;
            }
        }
    }
}

/// Cancellation of a streaming read.
#[derive(Default)]
pub struct Cancel {
    set: Cell<bool>,
    pub event: Event,
}

impl Cancel {
    pub fn is_set(&self) -> bool {
        self.set.get()
    }

    pub fn cancel(&self) {
        self.set.set(true);
        self.event.notify(usize::MAX);
    }
}

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
    /// Where this connection's replica acks gather.
    sink: Option<Rc<AckSink>>,
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
        sink: None,
    };
    conn.run(rd).await;
    conn.close();
}

/// Request id of a frame whose header is readable, else 0.
fn header_request_id(bytes: &[u8]) -> u64 {
    if bytes.len() >= 20 {
        u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"))
    } else {
        0
    }
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
                                let body_len =
                                    u32::from_le_bytes(avail[..4].try_into().expect("4 bytes"));
                                skip = HEADER_LEN + body_len as usize;
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
                    // Read the rest of this frame into a buffer of its own.
                    let mut big = Vec::with_capacity(total);
                    big.extend_from_slice(avail);
                    start = buf.len();
                    while big.len() < total {
                        let at = big.len();
                        let BufResult(res, b) = rd.read(big.slice(at..total)).await;
                        big = b.into_inner();
                        match res {
                            Ok(0) | Err(_) => return,
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
                    let keep = self
                        .handle(
                            frame,
                            Body::Owned(Chunk {
                                data: Arc::new(big),
                                range: payload_at..total,
                            }),
                        )
                        .await;
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

    /// Handles one frame; false closes the connection.
    async fn handle(&mut self, frame: Frame<'_>, body: Body<'_>) -> bool {
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
            Op::ROUTE => match wire::decode_name(frame.meta) {
                Ok(name) => match rotary_net::spec::validate_journal_name(name) {
                    Ok(()) => {
                        let body = self.route_json(name);
                        self.admin_ok(id, &body);
                    }
                    Err(e) => self.admin_err(id, Status::BAD_REQUEST, &e.to_string()),
                },
                Err(e) => self.admin_err(id, e.status(), &e.to_string()),
            },
            Op::REPLICATE => {
                let own = match &body {
                    Body::Owned(c) => Some(c.data.clone()),
                    Body::Borrowed(_) => None,
                };
                return self.replicate(payload, own.as_ref());
            }
            Op::SYNC => self.sync(frame.request_id, payload),
            Op::APPLY => self.apply(id, frame.flags, payload).await,
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

    fn admin_err(&self, id: u64, status: Status, message: &str) {
        self.outbox.error(Op::ADMIN_REPLY, status, id, &[], message);
    }

    fn admin_ok(&self, id: u64, body: &serde_json::Value) {
        let bytes = serde_json::to_vec(body).expect("json");
        self.outbox
            .frame(Op::ADMIN_REPLY, Status::OK, id, &[], &bytes);
    }

    fn append_error(&self, id: u64, status: Status, msg: &str) {
        self.outbox.error(
            Op::APPEND_REPLY,
            status,
            id,
            &AppendReply::default().encode(),
            msg,
        );
    }

    /// Remembers where a read went, for its CANCEL. Reads whose relay has
    /// passed on their last reply are forgotten once many have gathered.
    fn forward_read(&mut self, id: u64, addr: SocketAddr) {
        if self.forwarded_reads.len() >= self.forwarded_reads_prune_at {
            let relays = &self.relays;
            self.forwarded_reads.retain(|id, addr| {
                relays
                    .get(addr)
                    .is_some_and(|r| r.watch.pending.borrow().contains(id))
            });
            // Many reads still open (tails) are not scanned again at once.
            self.forwarded_reads_prune_at =
                FORWARDED_READS_PRUNE_AT.max(2 * self.forwarded_reads.len());
        }
        self.forwarded_reads.insert(id, addr);
    }

    /// Refuses an append at its first frame; its later chunks are dropped.
    fn refuse_append(&mut self, frame: &Frame<'_>, status: Status, msg: &str) {
        self.append_error(frame.request_id, status, msg);
        if frame.flags & flag::MORE != 0 {
            self.discard.insert(frame.request_id);
        }
    }

    async fn append(&mut self, frame: Frame<'_>, body: Body<'_>) {
        let id = frame.request_id;
        let raw = body.raw();
        let req = match AppendRequest::decode(frame.meta) {
            Ok(r) => r,
            Err(e) => return self.refuse_append(&frame, e.status(), &e.to_string()),
        };
        if let Err(e) = validate_journal_name(&req.journal) {
            return self.refuse_append(&frame, Status::BAD_REQUEST, &e.to_string());
        }
        if self.appends.contains_key(&id) || self.forwarded.contains_key(&id) {
            // The chunks that follow could belong to either: the open
            // append is rolled back too, rather than finished with the
            // other's bytes.
            if let Some((op, j)) = self.appends.remove(&id) {
                op.aborted.set(Some(AbortReason::Client));
                self.shard.mark_ready(&j);
            }
            // One forwarded is aborted where it went, which answers it.
            if let Some(addr) = self.forwarded.remove(&id) {
                if let Some(relay) = self.relays.get(&addr) {
                    let mut abort = Vec::new();
                    wire::encode_frame(
                        &mut abort,
                        Op::APPEND_CHUNK,
                        flag::ABORT,
                        Status::OK,
                        id,
                        &[],
                        &[],
                    );
                    relay.out.raw(&abort);
                }
            }
            return self.refuse_append(
                &frame,
                Status::BAD_REQUEST,
                "request id already in use by an open append; both are refused",
            );
        }
        let owner = rotary_net::shard_of(&req.journal, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            if frame.flags & flag::MORE != 0 {
                self.forwarded.insert(id, addr);
            }
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        if self.shard.is_shutting_down() {
            return self.refuse_append(&frame, Status::SHUTTING_DOWN, "broker is shutting down");
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            let (status, msg) = self.shard.unknown_journal(&req.journal);
            return self.refuse_append(&frame, status, &msg);
        };
        let role = self.shard.role(&j.borrow().spec);
        match role {
            Role::Primary(route) if !route.is_complete() => {
                let msg = format!(
                    "the journal's replication is {} but the cluster has {} broker(s) for it",
                    route.replication,
                    route.members.len()
                );
                return self.refuse_append(&frame, Status::INSUFFICIENT_JOURNAL_BROKERS, &msg);
            }
            Role::Primary(_) => {}
            Role::Replica(route) | Role::Outside(route) => {
                let Some(primary) = route.primary() else {
                    return self.refuse_append(
                        &frame,
                        Status::NO_JOURNAL_PRIMARY_BROKER,
                        "the journal's route is empty",
                    );
                };
                if frame.flags & flag::DO_NOT_PROXY != 0 {
                    let msg = format!(
                        "broker {} is not the journal's primary; its primary is {} at {}",
                        self.shard.view().me,
                        primary.id,
                        self.shard.member_endpoint(primary, &req.journal)
                    );
                    return self.refuse_append(&frame, Status::NOT_JOURNAL_PRIMARY_BROKER, &msg);
                }
                let addr = self.shard.member_endpoint(primary, &req.journal);
                if frame.flags & flag::MORE != 0 {
                    self.forwarded.insert(id, addr);
                }
                metrics::add(&self.shard.metrics.proxied_requests, 1);
                // The primary must not proxy it on again (views may differ
                // for a moment while a cluster file changes).
                return self
                    .proxy_to(addr, &with_flags(raw, flag::DO_NOT_PROXY, 0))
                    .await;
            }
        }
        if j.borrow().spec.flags == JournalFlags::ReadOnly {
            return self.refuse_append(&frame, Status::NOT_ALLOWED, "journal is read-only");
        }
        let more = frame.flags & flag::MORE != 0;
        let op = Rc::new(AppendOp {
            request_id: id,
            outbox: self.outbox.clone(),
            req,
            chunks: RefCell::new(Default::default()),
            complete: Cell::new(!more),
            aborted: Cell::new(None),
            finished: Cell::new(false),
            last_activity: Cell::new(Instant::now()),
            budget: self.budget.clone(),
            replica: None,
        });
        self.push_chunk(&op, &frame, body);
        if more {
            self.appends.insert(id, (op.clone(), j.clone()));
        }
        self.shard.submit_append(&j, op);
    }

    /// Queues a frame's payload on an append. A frame in its own buffer
    /// moves in whole (no copy); others are copied out of the read buffer.
    fn push_chunk(&self, op: &Rc<AppendOp>, frame: &Frame<'_>, body: Body<'_>) {
        let chunk = match body {
            Body::Owned(chunk) => chunk,
            Body::Borrowed(_) => Chunk {
                data: Arc::new(frame.payload.to_vec()),
                range: 0..frame.payload.len(),
            },
        };
        if chunk.range.is_empty() {
            return;
        }
        self.budget.charge(chunk.range.len());
        op.chunks.borrow_mut().push_back(chunk);
    }

    /// Takes a chunk of an open append. `misshapen` (from [`shape_error`])
    /// refuses it: the append is rolled back and answered with it, and its
    /// further chunks are dropped.
    fn append_chunk(
        &mut self,
        frame: Frame<'_>,
        body: Body<'_>,
        misshapen: Option<(Status, String)>,
    ) {
        let id = frame.request_id;
        let more = frame.flags & flag::MORE != 0;
        if self.discard.contains(&id) {
            if !more {
                self.discard.remove(&id);
            }
            return;
        }
        // A refused chunk ends its append here; the rest of it is dropped.
        let ends = !more || misshapen.is_some();
        if more && misshapen.is_some() {
            self.discard.insert(id);
        }
        if let Some(&addr) = self.forwarded.get(&id) {
            if ends {
                self.forwarded.remove(&id);
            }
            // Forwarding is async only while connecting; chunks follow an
            // APPEND that already connected the relay. A refused chunk goes
            // on as the append's last: where it went, the same check
            // answers it and rolls the append back.
            if let Some(relay) = self.relays.get(&addr) {
                match misshapen {
                    Some(_) => relay.out.raw(&with_flags(body.raw(), 0, flag::MORE)),
                    None => relay.out.raw(body.raw()),
                }
            }
            return;
        }
        let Some((op, j)) = self.appends.get(&id).cloned() else {
            let (status, msg) = misshapen.unwrap_or_else(|| {
                (
                    Status::BAD_REQUEST,
                    "APPEND_CHUNK without an open append of this request id".into(),
                )
            });
            self.append_error(id, status, &msg);
            if more {
                self.discard.insert(id);
            }
            return;
        };
        if ends {
            self.appends.remove(&id);
        }
        if op.finished.get() {
            return;
        }
        if let Some((status, msg)) = misshapen {
            // Answered here; the rollback then has nothing to say.
            op.reply_error(status, &AppendReply::default(), &msg);
            op.aborted.set(Some(AbortReason::Client));
            self.shard.mark_ready(&j);
            return;
        }
        op.last_activity.set(Instant::now());
        if frame.flags & flag::ABORT != 0 {
            op.aborted.set(Some(AbortReason::Client));
            self.appends.remove(&id);
            self.shard.mark_ready(&j);
            return;
        }
        self.push_chunk(&op, &frame, body);
        if !more {
            op.complete.set(true);
        }
        self.shard.mark_ready(&j);
    }

    async fn read(&mut self, frame: Frame<'_>, raw: &[u8]) {
        let id = frame.request_id;
        let req = match ReadRequest::decode(frame.meta) {
            Ok(r) => r,
            Err(e) => {
                return self
                    .outbox
                    .error(Op::READ_DONE, e.status(), id, &[0; 16], &e.to_string())
            }
        };
        if let Err(e) = validate_journal_name(&req.journal) {
            return self.outbox.error(
                Op::READ_DONE,
                Status::BAD_REQUEST,
                id,
                &[0; 16],
                &e.to_string(),
            );
        }
        let owner = rotary_net::shard_of(&req.journal, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            self.forward_read(id, addr);
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            let (status, msg) = self.shard.unknown_journal(&req.journal);
            return self.outbox.error(Op::READ_DONE, status, id, &[0; 16], &msg);
        };
        let role = self.shard.role(&j.borrow().spec);
        // A broker taking the journal over copies what this one holds.
        let takeover = frame.flags & flag::TAKEOVER != 0;
        if let (Role::Outside(route), false) = (role, takeover) {
            let Some(primary) = route.primary() else {
                return self.outbox.error(
                    Op::READ_DONE,
                    Status::NO_JOURNAL_PRIMARY_BROKER,
                    id,
                    &[0; 16],
                    "the journal's route is empty",
                );
            };
            let addr = self.shard.member_endpoint(primary, &req.journal);
            if frame.flags & (flag::DO_NOT_PROXY | flag::PROXIED) != 0 {
                let msg = format!(
                    "broker {} is not in the journal's route {:?}; read from {} at {addr}",
                    self.shard.view().me,
                    route.ids(),
                    primary.id
                );
                return self.outbox.error(
                    Op::READ_DONE,
                    Status::NOT_JOURNAL_BROKER,
                    id,
                    &[0; 16],
                    &msg,
                );
            }
            self.forward_read(id, addr);
            metrics::add(&self.shard.metrics.proxied_requests, 1);
            // Marked so that the primary, should its view of the cluster
            // differ from this broker's, refuses it instead of proxying it
            // on (or back).
            return self
                .proxy_to(addr, &with_flags(raw, flag::PROXIED, 0))
                .await;
        }
        if self.reads.borrow().contains_key(&id) {
            // A second read under one id could not be told apart, nor
            // cancelled.
            return self.outbox.error(
                Op::READ_DONE,
                Status::BAD_REQUEST,
                id,
                &[0; 16],
                "request id already in use by an open read",
            );
        }
        let cancel = Rc::new(Cancel::default());
        self.reads.borrow_mut().insert(id, cancel.clone());
        let reads = self.reads.clone();
        let shard = self.shard.clone();
        let outbox = self.outbox.clone();
        let flags = frame.flags;
        compio::runtime::spawn(async move {
            shard.read(j, outbox, id, req, flags, cancel).await;
            reads.borrow_mut().remove(&id);
        })
        .detach();
    }

    async fn apply(&self, id: u64, flags: u8, payload: &[u8]) {
        if let Some(control) = self.shard.topology().control() {
            return self.apply_in_etcd(control, id, payload).await;
        }
        let local = flags & flag::LOCAL != 0;
        let (specs, revision) = match parse_apply(payload, local) {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        if let Err(e) = check_specs(&specs) {
            return self.admin_err(id, Status::BAD_REQUEST, &e);
        }
        if let Err(e) = self.check_expected_revisions(payload, local) {
            return self.admin_err(id, Status::ETCD_TRANSACTION_FAILED, &e);
        }
        let revision = revision.unwrap_or_else(|| self.shard.specs.next_revision());
        let n = match self.shard.specs.apply_at(specs.clone(), revision) {
            Ok(n) => n,
            Err(e) => return self.admin_err(id, spec_write_status(&e), &e.to_string()),
        };
        let mut body = serde_json::json!({ "applied": n, "revision": revision });
        if !local {
            // Peers store the same revision.
            let revised = serde_json::to_vec(&serde_json::json!({
                "revision": revision,
                "specs": specs,
            }))
            .expect("json");
            if let Some(peers) = self.fan_out(Op::APPLY, &[], &revised).await {
                body["peers"] = peers;
            }
        }
        self.admin_ok(id, &body);
    }

    /// APPLY in a cluster on etcd: one transaction of every spec, each
    /// guarded by the revision the client gave with it (`"revision"`; 0:
    /// the journal must not exist), answered once this broker's spec store
    /// holds the change.
    async fn apply_in_etcd(&self, control: &ControlHandle, id: u64, payload: &[u8]) {
        let specs = match parse_apply_revised(payload) {
            Ok(s) => s,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        let plain: Vec<JournalSpec> = specs.iter().map(|(s, _)| s.clone()).collect();
        if let Err(e) = check_specs(&plain) {
            return self.admin_err(id, Status::BAD_REQUEST, &e);
        }
        let n = specs.len();
        match control.apply(specs).await {
            Ok(revision) => {
                self.wait_for_revision(revision).await;
                self.admin_ok(
                    id,
                    &serde_json::json!({ "applied": n, "revision": revision }),
                )
            }
            Err(e) => self.admin_err(id, control_status(&e), &e.to_string()),
        }
    }

    /// Outside etcd, the revisions a client's APPLY expects of its specs
    /// (as `journals list -o yaml` prints them) are checked against the
    /// store's, so that list, edit, apply is as safe a round trip as in a
    /// cluster on etcd. (Two APPLYs racing on different shards may both
    /// pass; etcd's transactions have no such gap.)
    fn check_expected_revisions(&self, payload: &[u8], local: bool) -> Result<(), String> {
        if local {
            return Ok(());
        }
        let Ok(revised) = parse_apply_revised(payload) else {
            return Ok(());
        };
        for (spec, expect) in revised {
            let Some(expect) = expect else { continue };
            let now = self
                .shard
                .specs
                .get_revised(&spec.name)
                .map_or(0, |r| r.revision);
            if now != expect as u64 {
                return Err(format!(
                    "journal {:?} is at revision {now}, not {expect}: list it again",
                    spec.name
                ));
            }
        }
        Ok(())
    }

    /// Waits (bounded) until the spec store took etcd's change at
    /// `revision`, so that a LIST right after an APPLY shows it.
    async fn wait_for_revision(&self, revision: i64) {
        let give_up = std::time::Instant::now() + REVISION_WAIT_MAX;
        while self.shard.specs.revision_seen() < revision as u64
            && std::time::Instant::now() < give_up
        {
            compio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Sends an admin request (with LOCAL) to every other broker of the
    /// cluster; returns each one's outcome, or None without a cluster.
    async fn fan_out(&self, op: Op, meta: &[u8], payload: &[u8]) -> Option<serde_json::Value> {
        let view = self.shard.view();
        if view.is_single() {
            return None;
        }
        let calls = view.brokers.iter().filter(|m| m.id != view.me).map(|m| async move {
            let res = crate::pipeline::unary(
                m.endpoint,
                op,
                flag::LOCAL,
                meta,
                payload,
                std::time::Duration::from_secs(5),
            )
            .await;
            let outcome = match res {
                Ok((Status::OK, _, _)) => "ok".to_string(),
                Ok((status, _, body)) => format!("{status}: {}", String::from_utf8_lossy(&body)),
                Err(e) => e,
            };
            if outcome != "ok" {
                tracing::warn!(peer = %m.id, ?op, outcome = %outcome, "a peer broker did not take the change");
            }
            (m.id.clone(), serde_json::Value::String(outcome))
        });
        let out: serde_json::Map<String, serde_json::Value> = futures_util::future::join_all(calls)
            .await
            .into_iter()
            .collect();
        Some(serde_json::Value::Object(out))
    }

    /// ROUTE's answer: this broker's shard for the journal, and its route.
    fn route_json(&self, name: &str) -> serde_json::Value {
        let shard = rotary_net::shard_of(name, self.shard.shards);
        let replication = self.shard.specs.get(name).map_or(1, |s| s.replication);
        let view = self.shard.view();
        let route = view.route(name, replication);
        let local = self.shard.endpoints[shard as usize].to_string();
        let members: Vec<serde_json::Value> = route
            .members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "id": m.id,
                    "zone": m.zone,
                    "endpoint": self.shard.member_endpoint(m, name).to_string(),
                })
            })
            .collect();
        let endpoint = self.shard.primary_endpoint(&route, name).to_string();
        serde_json::json!({
            "journal": name,
            "shard": shard,
            "shards": self.shard.shards,
            "endpoint": endpoint,
            "broker": view.me,
            "local_endpoint": local,
            "members": members,
        })
    }

    fn sink(&mut self) -> Rc<AckSink> {
        self.sink
            .get_or_insert_with(|| AckSink::new(self.outbox.clone()))
            .clone()
    }

    /// REPLICATE: records of a primary's appends. False closes the connection.
    fn replicate(&mut self, payload: &[u8], frame: Option<&Arc<Vec<u8>>>) -> bool {
        let records = match rotary_net::repl::decode_records(payload) {
            Ok(r) => r,
            Err(e) => {
                self.outbox
                    .error(Op::ERROR, Status::BAD_REQUEST, 0, &[], &e.to_string());
                return false;
            }
        };
        let sink = self.sink();
        for rec in records {
            let seq = rec.seq();
            let name = rec.journal();
            if rotary_net::shard_of(name, self.shard.shards) != self.shard.index {
                let msg = format!("journal {name:?} is not on shard {}", self.shard.index);
                sink.push(seq, Status::WRONG_ROUTE, msg.into_bytes());
                continue;
            }
            let Some(j) = self.shard.journal(name) else {
                let msg = format!("journal {name:?} does not exist here");
                sink.push(seq, Status::JOURNAL_NOT_FOUND, msg.into_bytes());
                continue;
            };
            let verdict = {
                let mut jm = j.borrow_mut();
                let t = jm.replica.get_or_insert_with(Default::default);
                match &rec {
                    repl::Record::Content { offset, bytes, .. } => {
                        t.on_content(seq, *offset, bytes.len() as u64)
                    }
                    repl::Record::Commit { begin, end, .. } => t.on_commit(seq, *begin, *end),
                    repl::Record::Rollback { .. } => t.on_rollback(seq),
                }
            };
            match verdict {
                Verdict::Start { seq, begin } => {
                    // The journal's earlier appends have all their content.
                    for (op, oj) in self.repl_ops.values() {
                        if Rc::ptr_eq(oj, &j) {
                            if let Some(r) = &op.replica {
                                r.content_done.set(true);
                            }
                        }
                    }
                    let op = self.replica_op(&j, &sink, seq, begin);
                    if let repl::Record::Content { bytes, .. } = &rec {
                        self.push_bytes(&op, bytes, frame);
                    }
                    self.repl_ops.insert(seq, (op.clone(), j.clone()));
                    self.shard.submit_append(&j, op);
                }
                Verdict::Continue { seq } => {
                    if let Some((op, _)) = self.repl_ops.get(&seq).cloned() {
                        if let repl::Record::Content { bytes, .. } = &rec {
                            self.push_bytes(&op, bytes, frame);
                        }
                        op.last_activity.set(Instant::now());
                        self.shard.mark_ready(&j);
                    }
                }
                Verdict::Commit { seq, .. } => {
                    let repl::Record::Commit {
                        end,
                        fragment_sha1,
                        registers,
                        ..
                    } = rec
                    else {
                        unreachable!("commit verdicts come from commit records")
                    };
                    let proposal = Proposal {
                        end,
                        fragment_sha1,
                        registers,
                    };
                    let Some((op, _)) = self.repl_ops.remove(&seq) else {
                        continue;
                    };
                    if let Some(r) = &op.replica {
                        *r.proposal.borrow_mut() = Some(proposal);
                    }
                    op.complete.set(true);
                    self.shard.mark_ready(&j);
                }
                Verdict::CommitEmpty { seq, .. } => sink.push(seq, Status::OK, Vec::new()),
                Verdict::Rollback { seqs, .. } => {
                    for seq in seqs {
                        if let Some((op, j)) = self.repl_ops.remove(&seq) {
                            op.aborted.set(Some(AbortReason::Closed));
                            self.shard.mark_ready(&j);
                        }
                    }
                }
                Verdict::Ignore => {}
                Verdict::Refuse {
                    seq,
                    status,
                    message,
                    rewind_to,
                } => {
                    match self
                        .shard
                        .shared_failures
                        .failed(crate::journal::SharedWork::Refusal, "")
                    {
                        Some(held) => {
                            tracing::warn!(journal = %name, seq, %status, %message, since_last_logged = held, "refused a replicated record; the primary must synchronize again (logged once a minute)");
                        }
                        None => {
                            tracing::debug!(journal = %name, seq, %status, %message, "refused a replicated record");
                        }
                    }
                    if rewind_to.is_some() {
                        self.abort_replica_ops(&j);
                    }
                    sink.push(seq, status, message.into_bytes());
                }
            }
        }
        true
    }

    fn replica_op(&self, j: &JournalRef, sink: &Rc<AckSink>, seq: u64, begin: u64) -> Rc<AppendOp> {
        Rc::new(AppendOp {
            request_id: seq,
            outbox: self.outbox.clone(),
            req: AppendRequest {
                journal: j.borrow().name.clone(),
                expect_offset: Some(begin),
                ..Default::default()
            },
            chunks: RefCell::new(Default::default()),
            complete: Cell::new(false),
            aborted: Cell::new(None),
            finished: Cell::new(false),
            last_activity: Cell::new(Instant::now()),
            budget: self.budget.clone(),
            replica: Some(ReplicaOp {
                sink: sink.clone(),
                proposal: RefCell::new(None),
                content_done: Cell::new(false),
            }),
        })
    }

    /// Queues a record's bytes on a replicated append: a range of the
    /// received frame's own buffer when it has one (no copy), else a copy.
    fn push_bytes(&self, op: &Rc<AppendOp>, bytes: &[u8], frame: Option<&Arc<Vec<u8>>>) {
        if bytes.is_empty() {
            return;
        }
        self.budget.charge(bytes.len());
        let shared = frame.and_then(|f| {
            let at = (bytes.as_ptr() as usize).checked_sub(f.as_ptr() as usize)?;
            (at + bytes.len() <= f.len()).then(|| Chunk {
                data: f.clone(),
                range: at..at + bytes.len(),
            })
        });
        op.chunks
            .borrow_mut()
            .push_back(shared.unwrap_or_else(|| Chunk {
                data: Arc::new(bytes.to_vec()),
                range: 0..bytes.len(),
            }));
    }

    /// Drops this connection's open replicated appends of a journal.
    fn abort_replica_ops(&mut self, j: &JournalRef) {
        let seqs: Vec<u64> = self
            .repl_ops
            .iter()
            .filter(|(_, (_, oj))| Rc::ptr_eq(oj, j))
            .map(|(k, _)| *k)
            .collect();
        for k in seqs {
            if let Some((op, _)) = self.repl_ops.remove(&k) {
                op.aborted.set(Some(AbortReason::Closed));
            }
        }
        self.shard.mark_ready(j);
    }

    /// SYNC: the primary's view of a journal, to be applied by the flusher.
    fn sync(&mut self, request_id: u64, payload: &[u8]) {
        let sink = self.sink();
        let req: rotary_net::repl::SyncRequest = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                return self.outbox.error(
                    Op::ERROR,
                    Status::BAD_REQUEST,
                    request_id,
                    &[],
                    &format!("SYNC: {e}"),
                )
            }
        };
        let view = self.shard.view();
        let route = view.route(&req.journal, req.spec.replication);
        let refuse = |status: Status, message: String| {
            let body = rotary_net::repl::SyncReply {
                message,
                route: route.ids(),
                ..Default::default()
            };
            sink.push(req.seq, status, serde_json::to_vec(&body).expect("json"));
        };
        if req.spec.name != req.journal || req.spec.validate().is_err() {
            return refuse(Status::BAD_REQUEST, "SYNC carries an invalid spec".into());
        }
        if let Err(e) = crate::specs::check_revision(req.revision) {
            return refuse(Status::BAD_REQUEST, format!("SYNC: {e}"));
        }
        if rotary_net::shard_of(&req.journal, self.shard.shards) != self.shard.index {
            return refuse(
                Status::WRONG_ROUTE,
                format!(
                    "journal {:?} is not on shard {}",
                    req.journal, self.shard.index
                ),
            );
        }
        // A broker that is the journal's primary by its own view, or that
        // neither holds the journal nor is in its route, has nothing to
        // synchronize: it answers at once and changes nothing (a broker the
        // journal left, which holds it, answers with its head once its
        // appends are through, below).
        let known = self.shard.journal(&req.journal).is_some();
        if route.is_primary(&view.me) || (!known && !route.contains(&view.me)) {
            let msg = crate::shard::route_disagreement(&view.me, &route, &req);
            return refuse(Status::WRONG_ROUTE, msg);
        }
        // A replica that missed an APPLY learns the spec from its primary;
        // one that saw the journal deleted after the primary's spec says so.
        if self
            .shard
            .specs
            .tombstone(&req.journal)
            .is_some_and(|t| t >= req.revision)
        {
            return refuse(
                Status::JOURNAL_NOT_FOUND,
                format!(
                    "journal {:?} was deleted after the primary's spec (revision {})",
                    req.journal, req.revision
                ),
            );
        }
        if self.shard.specs.get(&req.journal).as_ref() != Some(&req.spec) {
            if let Err(e) = self
                .shard
                .specs
                .apply_at(vec![req.spec.clone()], req.revision)
            {
                return refuse(Status::IO_ERROR, e.to_string());
            }
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            return refuse(Status::JOURNAL_NOT_FOUND, "journal vanished".into());
        };
        self.abort_replica_ops(&j);
        j.borrow_mut().sync_waiters.push(SyncWaiter { sink, req });
        self.shard.mark_ready(&j);
    }

    fn list(&self, id: u64, payload: &[u8]) {
        let req = match SelectorRequest::parse(payload, "list") {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        let sel = &req.selector;
        let (page, more) = self.shard.specs.page(
            &req.after,
            req.limit,
            |s| sel.matches(&s.labels),
            req.deleted,
        );
        let view = self.shard.view();
        let out: Vec<ListedOut> = page
            .into_iter()
            .map(|entry| match entry {
                crate::specs::Entry::Spec(r) => {
                    let name = &r.spec.name;
                    let shard = rotary_net::shard_of(name, self.shard.shards);
                    let route = view.route(name, r.spec.replication);
                    let endpoint = self.shard.primary_endpoint(&route, name);
                    let members: Vec<String> = route.members.into_iter().map(|m| m.id).collect();
                    ListedOut::Spec {
                        route: ListedRoute {
                            shard,
                            endpoint: endpoint.to_string(),
                            primary: members.first().cloned().unwrap_or_default(),
                            members,
                            etcd_revision: view.assigned.as_ref().map(|a| a.revision),
                        },
                        spec: Box::new(r.spec),
                        revision: r.revision,
                    }
                }
                crate::specs::Entry::Deleted(t) => ListedOut::Deleted {
                    deleted: t.name,
                    revision: t.revision,
                },
            })
            .collect();
        // A broker still learning its peers' specs lists what it knows, and
        // says that journals may be missing.
        let mut flags = 0;
        if !self.shard.specs.is_caught_up() {
            flags |= flag::PARTIAL;
        }
        // A page also ends before its reply would outgrow a frame (specs
        // may carry many labels); the next one starts after its last name.
        let (bytes, listed) = json_array_within(&out, wire::PAYLOAD_LEN_MAX);
        if more || listed < out.len() {
            flags |= flag::NEXT_PAGE;
        }
        self.outbox
            .flagged_frame(Op::ADMIN_REPLY, flags, Status::OK, id, &[], &bytes);
    }

    async fn prune(&self, id: u64, payload: &[u8]) {
        let req = match SelectorRequest::parse(payload, "prune") {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        match self.shard.prune(&req.selector, req.dry_run).await {
            Ok(removed) => self.admin_ok(id, &serde_json::Value::Array(removed)),
            Err(e) => self.admin_err(id, Status::FRAGMENT_STORE_UNHEALTHY, &e),
        }
    }

    async fn by_name(&mut self, frame: Frame<'_>, raw: &[u8]) {
        let id = frame.request_id;
        let name = match wire::decode_name(frame.meta) {
            Ok(n) => n.to_string(),
            Err(e) => return self.admin_err(id, e.status(), &e.to_string()),
        };
        if let Err(e) = validate_journal_name(&name) {
            return self.admin_err(id, Status::BAD_REQUEST, &e.to_string());
        }
        let owner = rotary_net::shard_of(&name, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        let not_found = format!("journal {name:?} does not exist");
        match frame.op {
            Op::DELETE if self.shard.topology().control().is_some() => {
                let control = self.shard.topology().control().expect("etcd").clone();
                let expect = match parse_delete_expect(frame.payload) {
                    Ok(r) => r,
                    Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
                };
                match control.delete(name.clone(), expect).await {
                    Ok(revision) => {
                        self.wait_for_revision(revision).await;
                        self.admin_ok(
                            id,
                            &serde_json::json!({ "deleted": name, "revision": revision }),
                        )
                    }
                    Err(ControlError::TxnFailed(_)) if expect.is_none() => {
                        self.admin_err(id, Status::JOURNAL_NOT_FOUND, &not_found)
                    }
                    Err(e) => self.admin_err(id, control_status(&e), &e.to_string()),
                }
            }
            Op::DELETE => {
                let is_local = frame.flags & flag::LOCAL != 0;
                let revision = match parse_revision(frame.payload, is_local) {
                    Ok(r) => r.unwrap_or_else(|| self.shard.specs.next_revision()),
                    Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
                };
                let local = self.shard.delete_journal(&name, revision);
                let peers = if !is_local {
                    let revised = delete_payload(revision);
                    self.fan_out(Op::DELETE, frame.meta, &revised).await
                } else {
                    None
                };
                let peer_had = peers.as_ref().is_some_and(|p| {
                    p.as_object()
                        .is_some_and(|m| m.values().any(|v| v.as_str() == Some("ok")))
                });
                match local {
                    Ok(existed) if existed || peer_had => {
                        let mut body = serde_json::json!({ "deleted": name });
                        if let Some(p) = peers {
                            body["peers"] = p;
                        }
                        self.admin_ok(id, &body)
                    }
                    Ok(_) => self.admin_err(id, Status::JOURNAL_NOT_FOUND, &not_found),
                    Err(e) => self.admin_err(id, spec_write_status(&e), &e.to_string()),
                }
            }
            op => {
                let Some(j) = self.shard.journal(&name) else {
                    let (status, msg) = self.shard.unknown_journal(&name);
                    return self.admin_err(id, status, &msg);
                };
                if matches!(op, Op::SEAL | Op::RESET_HEAD) {
                    // Only the primary decides where fragments end.
                    let role = self.shard.role(&j.borrow().spec);
                    if let Role::Replica(route) | Role::Outside(route) = role {
                        if let Some(p) = route.primary() {
                            let addr = self.shard.member_endpoint(p, &name);
                            metrics::add(&self.shard.metrics.proxied_requests, 1);
                            return self.forward_to(addr, raw).await;
                        }
                    }
                }
                match op {
                    Op::FRAGMENTS => {
                        let page = match PageRequest::parse(frame.payload) {
                            Ok(p) => p,
                            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
                        };
                        // Before the first listing of its store a journal's
                        // fragments are not known: the answer waits for it
                        // (in its own task; the connection goes on), or is
                        // the listing's error.
                        let shard = self.shard.clone();
                        let outbox = self.outbox.clone();
                        compio::runtime::spawn(async move {
                            let deadline = Instant::now() + FRAGMENTS_LISTING_WAIT;
                            loop {
                                let listen = j.borrow().committed.listen();
                                let (listed, failed) = {
                                    let jm = j.borrow();
                                    (jm.index_loaded, jm.index_error.clone())
                                };
                                if listed {
                                    break;
                                }
                                let left = deadline.saturating_duration_since(Instant::now());
                                let failed = failed.or_else(|| {
                                    left.is_zero().then(|| {
                                        format!("no listing in {FRAGMENTS_LISTING_WAIT:?}")
                                    })
                                });
                                if let Some(e) = failed {
                                    let msg = format!("fragment index not yet listed: {e}");
                                    outbox.error(
                                        Op::ADMIN_REPLY,
                                        Status::FRAGMENT_STORE_UNHEALTHY,
                                        id,
                                        &[],
                                        &msg,
                                    );
                                    return;
                                }
                                if outbox.is_closed() {
                                    return;
                                }
                                // Ahead of the shard's queue, as a read's.
                                shard.hurry_first_listing(&j);
                                let _ = compio::time::timeout(left, listen).await;
                            }
                            let (body, more) = shard.fragments_page(&j, page.from, page.limit);
                            let bytes = serde_json::to_vec(&body).expect("json");
                            let flags = if more { flag::NEXT_PAGE } else { 0 };
                            outbox.flagged_frame(
                                Op::ADMIN_REPLY,
                                flags,
                                Status::OK,
                                id,
                                &[],
                                &bytes,
                            );
                        })
                        .detach();
                    }
                    Op::RESET_HEAD => self.shard.request_reset_head(&j, self.outbox.clone(), id),
                    Op::SEAL => self.shard.request_seal(&j, self.outbox.clone(), id),
                    _ => unreachable!("by_name handles DELETE, FRAGMENTS, SEAL, RESET_HEAD"),
                }
            }
        }
    }

    /// Proxies a client's append or read to another broker, marked so that
    /// the peer serves it itself or refuses it. A refusal (the two brokers'
    /// views of the cluster differ while a cluster file changes) reaches
    /// the client as the retryable `WRONG_ROUTE`: the client did not ask
    /// the wrong broker, and the same request succeeds once the views agree.
    async fn proxy_to(&mut self, addr: SocketAddr, raw: &[u8]) {
        self.forward_to(addr, raw).await;
        if let Some(relay) = self.relays.get(&addr) {
            relay
                .watch
                .proxied
                .borrow_mut()
                .insert(header_request_id(raw));
        }
    }

    /// Sends a raw request frame to another shard or broker over this
    /// connection's relay to it; replies flow back to the client as they are
    /// (but see [`Conn::proxy_to`]).
    async fn forward_to(&mut self, addr: SocketAddr, raw: &[u8]) {
        if self.relays.get(&addr).is_none_or(|r| r.out.is_closed()) {
            // A peer that does not answer the SYN would hold this
            // connection's requests for the kernel's minutes.
            let connect = compio::time::timeout(RELAY_CONNECT_TIMEOUT, TcpStream::connect(addr));
            let connected = connect.await.unwrap_or_else(|_| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {RELAY_CONNECT_TIMEOUT:?}"),
                ))
            });
            let stream = match connected {
                Ok(s) => s,
                Err(e) => {
                    let id = header_request_id(raw);
                    self.outbox.error(
                        Op::ERROR,
                        Status::IO_ERROR,
                        id,
                        &[],
                        &format!("forwarding to {addr}: {e}"),
                    );
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            keep_alive(&stream);
            let (rd, wr) = stream.into_split();
            let relay = Relay {
                out: Rc::new(Outbox::new()),
                watch: Rc::new(RelayWatch::new()),
            };
            compio::runtime::spawn(outbox::writer(wr, relay.out.clone())).detach();
            compio::runtime::spawn(pump(rd, self.outbox.clone(), relay.clone())).detach();
            let silence = self.shard.peer_silence;
            compio::runtime::spawn(watch(addr, self.outbox.clone(), relay.clone(), silence))
                .detach();
            self.relays.insert(addr, relay);
        }
        if let Some(relay) = self.relays.get(&addr) {
            if let Ok(Some((h, _))) = wire::decode_header(raw, u32::MAX) {
                if Op::from_code(h.op) != Some(Op::CANCEL) {
                    relay.watch.pending.borrow_mut().insert(h.request_id.get());
                }
            }
            relay.out.raw(raw);
        }
    }

    fn close(&mut self) {
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

/// One entry of LIST's answer (PROTOCOL §9.3).
#[derive(serde::Serialize)]
#[serde(untagged)]
enum ListedOut {
    Spec {
        spec: Box<JournalSpec>,
        revision: u64,
        route: ListedRoute,
    },
    Deleted {
        deleted: String,
        revision: u64,
    },
}

/// ROUTE's answer in short, for LIST.
#[derive(serde::Serialize)]
struct ListedRoute {
    shard: u32,
    endpoint: String,
    /// The primary's id; empty if the route has no members.
    primary: String,
    members: Vec<String>,
    /// In a cluster on etcd, the etcd revision the route was read at.
    #[serde(skip_serializing_if = "Option::is_none")]
    etcd_revision: Option<i64>,
}

/// The status of a change of specs that could not be stored: a full disk
/// (or quota) is the retryable `STORAGE_FULL`, anything else `IO_ERROR`.
fn spec_write_status(e: &crate::EngineError) -> Status {
    match e {
        crate::EngineError::Io(_, io)
            if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            Status::STORAGE_FULL
        }
        _ => Status::IO_ERROR,
    }
}

/// The JSON payload of LIST and PRUNE: `{"selector": "…", "dry_run": bool}`,
/// and for LIST `"deleted"`, `"after"` and `"limit"`, every field optional,
/// an empty payload meaning `{}`.
struct SelectorRequest {
    selector: LabelSelector,
    dry_run: bool,
    /// LIST: also the tombstones of deleted journals.
    deleted: bool,
    /// LIST: the page begins after this name.
    after: String,
    /// LIST: the most entries of the page.
    limit: usize,
}

impl SelectorRequest {
    fn parse(payload: &[u8], what: &str) -> Result<Self, String> {
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            selector: String,
            #[serde(default)]
            dry_run: bool,
            #[serde(default)]
            deleted: bool,
            #[serde(default)]
            after: String,
            limit: Option<u32>,
        }
        let raw: Raw = if payload.is_empty() {
            Raw::default()
        } else {
            serde_json::from_slice(payload).map_err(|e| format!("{what}: {e}"))?
        };
        let selector = LabelSelector::parse(&raw.selector).map_err(|e| e.to_string())?;
        let max = wire::LIST_PAGE_MAX;
        let limit = raw.limit.unwrap_or(max);
        if limit == 0 || limit > max {
            return Err(format!("{what}: limit {limit} is outside 1..={max}"));
        }
        if what != "list" && (raw.limit.is_some() || !raw.after.is_empty() || raw.deleted) {
            return Err(format!(
                "{what}: after, limit and deleted are fields of list"
            ));
        }
        Ok(SelectorRequest {
            selector,
            dry_run: raw.dry_run,
            deleted: raw.deleted,
            after: raw.after,
            limit: limit as usize,
        })
    }
}

/// The JSON payload of FRAGMENTS: `{"from": <offset>, "limit": <n>}`,
/// both optional, an empty payload meaning `{}` (PROTOCOL §9.5).
struct PageRequest {
    from: u64,
    limit: usize,
}

impl PageRequest {
    fn parse(payload: &[u8]) -> Result<Self, String> {
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            from: u64,
            limit: Option<u32>,
        }
        let raw: Raw = if payload.is_empty() {
            Raw::default()
        } else {
            serde_json::from_slice(payload).map_err(|e| format!("fragments: {e}"))?
        };
        let max = wire::FRAGMENTS_PAGE_MAX;
        let limit = raw.limit.unwrap_or(max);
        if limit == 0 || limit > max {
            return Err(format!("fragments: limit {limit} is outside 1..={max}"));
        }
        Ok(PageRequest {
            from: raw.from,
            limit: limit as usize,
        })
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
        Op::APPEND_CHUNK | Op::APPLY | Op::LIST | Op::STATS | Op::PING | Op::PRUNE
    );
    if no_meta && meta_len != 0 {
        return Some((
            Status::BAD_REQUEST,
            format!("{op:?} carries no meta; this one has {meta_len} bytes"),
        ));
    }
    let no_payload = matches!(
        op,
        Op::READ | Op::ROUTE | Op::SEAL | Op::STATS | Op::RESET_HEAD
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

/// Forwarded reads a connection remembers before it forgets those answered.
const FORWARDED_READS_PRUNE_AT: usize = 1024;

/// A connection to another shard or broker that a client connection's
/// requests are forwarded or proxied over.
#[derive(Clone)]
struct Relay {
    out: Rc<Outbox>,
    watch: Rc<RelayWatch>,
}

/// What a relay has in flight, and when it last heard from its peer.
struct RelayWatch {
    /// Requests forwarded and not yet given their final reply.
    pending: RefCell<HashSet<u64>>,
    /// Of those, the ones proxied to another broker (see
    /// [`Conn::proxy_to`]).
    proxied: RefCell<HashSet<u64>>,
    heard: Cell<Instant>,
    /// Given up on: what arrives from the peer later is dropped.
    abandoned: Cell<bool>,
}

impl RelayWatch {
    fn new() -> Self {
        RelayWatch {
            pending: RefCell::new(HashSet::new()),
            proxied: RefCell::new(HashSet::new()),
            heard: Cell::new(Instant::now()),
            abandoned: Cell::new(false),
        }
    }
}

/// A peer's refusal of a request this broker proxied to it, as the client
/// gets it: status `WRONG_ROUTE`, the same meta, the peer's message with
/// what it means for the client.
fn refused_by_peer(frame: &[u8], meta_len: usize) -> Vec<u8> {
    let body = &frame[HEADER_LEN..];
    let (meta, message) = body.split_at(meta_len.min(body.len()));
    let message = format!(
        "{} (this broker proxied the request, and the two brokers' views of the cluster \
         differ while a cluster file changes; retry)",
        String::from_utf8_lossy(message)
    );
    let mut out = frame[..HEADER_LEN].to_vec();
    let body_len = (meta.len() + message.len()) as u32;
    out[..4].copy_from_slice(&body_len.to_le_bytes());
    // Header: body_len u32, magic u16, op u8, flags u8, status u16, …
    out[8..10].copy_from_slice(&(Status::WRONG_ROUTE as u16).to_le_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(message.as_bytes());
    out
}

/// Request id of a relay's own PINGs: its PONG is not the client's.
const RELAY_PROBE_ID: u64 = u64::MAX;

/// Copies whole reply frames from a relay connection to the client, all
/// but the answers to the relay's own PINGs.
async fn pump(mut rd: TcpStream, client: Rc<Outbox>, relay: Relay) {
    let mut buf: Vec<u8> = Vec::with_capacity(READ_BUFFER_BYTES);
    loop {
        let mut start = 0;
        while let Ok(Some((h, total))) = wire::decode_header(&buf[start..], u32::MAX) {
            if buf.len() - start < total {
                break;
            }
            let id = h.request_id.get();
            let op = Op::from_code(h.op);
            if op == Some(Op::PONG) && id == RELAY_PROBE_ID {
                start += total;
                continue;
            }
            let frame = &buf[start..start + total];
            if !matches!(op, Some(Op::READ_DATA | Op::READ_FRAGMENT)) {
                relay.watch.pending.borrow_mut().remove(&id);
                let proxied = relay.watch.proxied.borrow_mut().remove(&id);
                let status = Status::from_code(h.status.get());
                if proxied
                    && matches!(
                        status,
                        Some(Status::NOT_JOURNAL_PRIMARY_BROKER | Status::NOT_JOURNAL_BROKER)
                    )
                {
                    client.raw(&refused_by_peer(frame, h.meta_len.get().into()));
                    start += total;
                    continue;
                }
            }
            client.raw(frame);
            start += total;
        }
        buf.drain(..start);
        if buf.capacity() - buf.len() < READ_BUFFER_BYTES / 4 {
            buf.reserve(READ_BUFFER_BYTES);
        }
        if client.is_closed() || relay.watch.abandoned.get() {
            break;
        }
        let BufResult(res, b) = rd.read(buf.uninit()).await;
        buf = b.into_inner();
        if relay.watch.abandoned.get() {
            // Its requests were answered already.
            return;
        }
        relay.watch.heard.set(Instant::now());
        match res {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        client.room().await;
    }
    // Requests in flight over the relay will get no answer: closing the
    // client's connection tells it so (it retries elsewhere).
    if !relay.out.is_closed() {
        client.close();
    }
    relay.out.close();
}

/// Watches a relay whose requests wait: after `silence` without a byte
/// from its peer it sends a PING, and after `silence` more with still
/// nothing it answers each of them `IO_ERROR` and closes the relay. The
/// client's connection stays: its other requests are not the peer's.
async fn watch(peer: SocketAddr, client: Rc<Outbox>, relay: Relay, silence: Duration) {
    // When the PING went out, if one is unanswered.
    let mut probe: Option<Instant> = None;
    loop {
        compio::time::sleep(silence / 4).await;
        if relay.out.is_closed() || client.is_closed() {
            return;
        }
        if relay.watch.pending.borrow().is_empty() {
            probe = None;
            continue;
        }
        let heard = relay.watch.heard.get();
        if probe.is_some_and(|p| heard >= p) {
            probe = None;
        }
        let quiet = heard.elapsed();
        if quiet < silence {
            continue;
        }
        match probe {
            None => {
                probe = Some(Instant::now());
                let mut ping = Vec::new();
                wire::encode_frame(&mut ping, Op::PING, 0, Status::OK, RELAY_PROBE_ID, &[], &[]);
                relay.out.raw(&ping);
                continue;
            }
            Some(p) if p.elapsed() < silence => continue,
            Some(_) => {}
        }
        relay.watch.abandoned.set(true);
        let pending: Vec<u64> = relay.watch.pending.borrow_mut().drain().collect();
        tracing::warn!(%peer, requests = pending.len(), ?quiet, "a peer answered nothing, not even a PING: its requests are answered IO_ERROR");
        let msg = format!(
            "{peer}, which the request was forwarded to, sent nothing for {quiet:.1?}, not even an answer to a PING"
        );
        for id in pending {
            client.error(Op::ERROR, Status::IO_ERROR, id, &[], &msg);
        }
        relay.out.close();
        return;
    }
}

/// APPLY's payload: a JSON array of specs from a client, or, from a peer
/// broker (flag LOCAL), `{"revision": N, "specs": [...]}` so that every
/// broker stores the change at the same revision.
fn parse_apply(payload: &[u8], local: bool) -> Result<(Vec<JournalSpec>, Option<u64>), String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Revised {
        revision: u64,
        specs: Vec<JournalSpec>,
    }
    // serde's own message for `{...}` is "invalid type: map", even when
    // the text is not JSON at all: say what is expected first.
    let refuse =
        |e: serde_json::Error| Err(format!("specs must be a JSON array of journal specs: {e}"));
    match serde_json::from_slice::<Vec<JournalSpec>>(payload) {
        Ok(specs) => Ok((specs, None)),
        // Specs that carry the revision they expect (checked apart).
        Err(_) if !local && parse_apply_revised(payload).is_ok() => {
            let specs = parse_apply_revised(payload)?;
            Ok((specs.into_iter().map(|(s, _)| s).collect(), None))
        }
        Err(e) if !local => refuse(e),
        Err(e) => match serde_json::from_slice::<Revised>(payload) {
            Ok(r) => Ok((r.specs, Some(crate::specs::check_revision(r.revision)?))),
            Err(_) => refuse(e),
        },
    }
}

/// Checks specs applied together: each one, no journal twice, and every
/// store URL in full (a store the uploader could not use would fail every
/// append of the journal later, with a retryable status).
fn check_specs(specs: &[JournalSpec]) -> Result<(), String> {
    rotary_net::spec::validate_specs(specs).map_err(|e| e.to_string())?;
    for s in specs {
        for store in &s.fragment.stores {
            let url = rotary_uploader::StoreUrl::parse(store)
                .map_err(|e| format!("spec of {:?}: {e}", s.name))?;
            if let Some(dir) = url.file_dir() {
                check_store_dir(dir).map_err(|e| format!("spec of {:?}: {e}", s.name))?;
            }
        }
    }
    Ok(())
}

/// A `file://` store's directory need not exist yet (uploads create it),
/// but nothing on its path may be a file that is not a directory: every
/// upload would fail.
fn check_store_dir(dir: &std::path::Path) -> Result<(), String> {
    // Without the trailing '/': `file/` does not "exist", `file` does.
    let dir: std::path::PathBuf = dir.components().collect();
    let Some(existing) = dir.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    if existing.is_dir() {
        Ok(())
    } else {
        Err(format!(
            "store directory {}: {} exists and is not a directory",
            dir.display(),
            existing.display()
        ))
    }
}

/// Longest a FRAGMENTS request waits for its journal's first store listing.
const FRAGMENTS_LISTING_WAIT: Duration = Duration::from_secs(30);

/// How long an APPLY or DELETE in a cluster on etcd waits for the watch
/// to bring its change to this broker before it answers all the same.
const REVISION_WAIT_MAX: Duration = Duration::from_secs(5);

/// The status of a request the control thread could not carry out.
fn control_status(e: &ControlError) -> Status {
    match e {
        ControlError::TxnFailed(_) => Status::ETCD_TRANSACTION_FAILED,
        ControlError::Etcd(_) | ControlError::Gone => Status::IO_ERROR,
    }
}

/// APPLY's payload in a cluster on etcd: a JSON array of journal specs,
/// each of which may carry `"revision"`, the revision of the journal's
/// spec the change was made from (0: the journal must not exist yet).
fn parse_apply_revised(payload: &[u8]) -> Result<Vec<(JournalSpec, Option<i64>)>, String> {
    let values: Vec<serde_json::Value> = serde_json::from_slice(payload)
        .map_err(|e| format!("specs must be a JSON array of journal specs: {e}"))?;
    values
        .into_iter()
        .map(|mut v| {
            let revision =
                match v.as_object_mut().and_then(|o| o.remove("revision")) {
                    None => None,
                    Some(r) => Some(r.as_i64().filter(|r| *r >= 0).ok_or_else(|| {
                        format!("revision {r} is not a whole number of 0 or more")
                    })?),
                };
            let spec: JournalSpec = serde_json::from_value(v).map_err(|e| e.to_string())?;
            Ok((spec, revision))
        })
        .collect()
}

/// DELETE's payload in a cluster on etcd: empty, or `{"revision": N}`, the
/// revision of the spec the deletion was decided on.
fn parse_delete_expect(payload: &[u8]) -> Result<Option<i64>, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Revision {
        revision: i64,
    }
    if payload.is_empty() {
        return Ok(None);
    }
    let r = serde_json::from_slice::<Revision>(payload).map_err(|e| format!("delete: {e}"))?;
    Ok(Some(r.revision))
}

/// DELETE's payload from a peer broker (flag LOCAL): the deletion's
/// revision, `{"revision": N}`. Read back by [`parse_revision`].
pub(crate) fn delete_payload(revision: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "revision": revision })).expect("json")
}

/// DELETE's payload: empty, or from a peer broker (flag LOCAL)
/// `{"revision": N}`.
fn parse_revision(payload: &[u8], local: bool) -> Result<Option<u64>, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Revision {
        revision: u64,
    }
    if payload.is_empty() {
        return Ok(None);
    }
    if !local {
        return Err("DELETE takes no payload".into());
    }
    let r = serde_json::from_slice::<Revision>(payload).map_err(|e| format!("delete: {e}"))?;
    crate::specs::check_revision(r.revision)
        .map(Some)
        .map_err(|e| format!("delete: {e}"))
}

/// The JSON array of as many of `entries`, from the first, as fit in
/// `limit` bytes, at least one; and how many that is. Each entry is
/// serialized once.
fn json_array_within<T: serde::Serialize>(entries: &[T], limit: usize) -> (Vec<u8>, usize) {
    let mut out = vec![b'['];
    let mut n = 0;
    for e in entries {
        let json = serde_json::to_vec(e).expect("json");
        // A comma before it, unless first, and the closing bracket.
        if n > 0 && out.len() + 1 + json.len() + 1 > limit {
            break;
        }
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&json);
        n += 1;
    }
    out.push(b']');
    (out, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_array_within_keeps_to_its_limit() {
        let entries: Vec<String> = (0..10).map(|i| format!("{i:08}")).collect();
        for limit in 0..150 {
            let (bytes, k) = json_array_within(&entries, limit);
            assert_eq!(bytes, serde_json::to_vec(&entries[..k]).unwrap());
            assert!(k >= 1);
            assert!(
                bytes.len() <= limit || k == 1,
                "limit {limit}: {k} entries, {} bytes",
                bytes.len()
            );
            if k < entries.len() {
                let more = serde_json::to_vec(&entries[..k + 1]).unwrap().len();
                assert!(more > limit, "limit {limit}: {k} entries, one more fits");
            }
        }
    }

    /// A peer's refusal of a proxied request keeps its op, id and meta, and
    /// becomes the retryable WRONG_ROUTE with the peer's message kept.
    #[test]
    fn refusals_of_proxied_requests_become_wrong_route() {
        let meta = [7u8; 16];
        let mut frame = Vec::new();
        wire::encode_frame(
            &mut frame,
            Op::READ_DONE,
            0,
            Status::NOT_JOURNAL_BROKER,
            42,
            &meta,
            b"broker b2 is not in the journal's route",
        );
        let out = refused_by_peer(&frame, meta.len());
        let (h, total) = wire::decode_header(&out, BODY_LEN_MAX).unwrap().unwrap();
        assert_eq!(total, out.len());
        assert_eq!(Op::from_code(h.op), Some(Op::READ_DONE));
        assert_eq!(Status::from_code(h.status.get()), Some(Status::WRONG_ROUTE));
        assert!(Status::WRONG_ROUTE.is_retryable());
        assert_eq!(h.request_id.get(), 42);
        assert_eq!(usize::from(h.meta_len.get()), meta.len());
        let body = &out[HEADER_LEN..];
        assert_eq!(&body[..16], &meta);
        let message = std::str::from_utf8(&body[16..]).unwrap();
        assert!(
            message.starts_with("broker b2 is not in the journal's route (this broker proxied"),
            "{message}"
        );
    }

    /// Connections charge their shard's budget with what they queue; one
    /// holding 1 MiB or more waits while the shard's budget is spent, one
    /// holding less reads on, and releases count only what was charged.
    #[test]
    fn a_spent_shard_budget_holds_back_connections_with_much_queued() {
        let shard = Rc::new(QueueBudget::new(3 << 20, None));
        let (a, b) = (Budget::new(shard.clone()), Budget::new(shard.clone()));
        let ready = |budget: &Budget, shared: bool| {
            let fut = std::pin::pin!(budget.below(CONN_APPEND_QUEUE_BYTES_MAX, shared));
            let waker = std::task::Waker::noop();
            std::future::Future::poll(fut, &mut std::task::Context::from_waker(waker)).is_ready()
        };
        a.charge(2 << 20);
        b.charge(512 << 10);
        assert_eq!(shard.used.get(), (2 << 20) + (512 << 10));
        assert!(ready(&a, true) && ready(&b, true));
        b.charge(512 << 10);
        assert!(shard.spent());
        assert!(!ready(&a, true) && !ready(&b, true));
        // Not held back by the shard: a replication stream.
        assert!(ready(&a, false));
        // Releasing more than was charged releases what was.
        b.release(4 << 20);
        assert_eq!((b.used.get(), shard.used.get()), (0, 2 << 20));
        assert!(ready(&a, true) && ready(&b, true));
        a.charge(CONN_APPEND_QUEUE_BYTES_MAX);
        assert!(!ready(&a, false));
    }
}
