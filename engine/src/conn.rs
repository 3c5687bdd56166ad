//! One client connection on a shard: decodes frames, dispatches requests
//! to the shard, forwards requests for journals of other shards, and
//! answers every malformed request with a status.

use crate::journal::{AbortReason, AppendOp, Chunk};
use crate::metrics;
use crate::outbox::{self, Outbox};
use crate::shard::{JournalRef, Shard};
use compio::buf::{BufResult, IntoInner, IoBuf, IoBufMut};
use compio::io::AsyncRead;
use compio::net::TcpStream;
use event_listener::Event;
use rotary_net::spec::{validate_journal_name, JournalFlags, JournalSpec, LabelSelector};
use rotary_net::status::Status;
use rotary_net::wire::{
    self, flag, AppendReply, AppendRequest, Frame, Op, ReadRequest, BODY_LEN_MAX, HEADER_LEN,
};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Instant;

/// Append bytes a connection may have queued before the broker stops
/// reading from it.
pub const CONN_APPEND_QUEUE_BYTES_MAX: usize = 64 << 20;
/// Frames at least this large are read into their own buffer, which then
/// becomes the append's chunk without a copy.
const LARGE_FRAME_BYTES: usize = 128 << 10;
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Append bytes queued by a connection and not yet staged.
#[derive(Default)]
pub struct Budget {
    used: Cell<usize>,
    event: Event,
}

impl Budget {
    pub fn charge(&self, n: usize) {
        self.used.set(self.used.get() + n);
    }

    pub fn release(&self, n: usize) {
        self.used.set(self.used.get().saturating_sub(n));
        self.event.notify(usize::MAX);
    }

    async fn below(&self, limit: usize) {
        while self.used.get() >= limit {
            let l = self.event.listen();
            if self.used.get() < limit {
                return;
            }
            l.await;
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
    /// Requests forwarded to another shard, by request id.
    forwarded: HashMap<u64, u32>,
    relays: Vec<Option<Rc<Outbox>>>,
}

pub async fn serve(shard: Rc<Shard>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    metrics::add(&shard.metrics.connections, 1);
    let (rd, wr) = stream.into_split();
    let outbox = Rc::new(Outbox::new());
    compio::runtime::spawn(outbox::writer(wr, outbox.clone())).detach();
    let relays = vec![None; shard.shards as usize];
    let mut conn = Conn {
        shard,
        outbox,
        budget: Rc::new(Budget::default()),
        appends: HashMap::new(),
        discard: HashSet::new(),
        reads: Rc::new(RefCell::new(HashMap::new())),
        forwarded: HashMap::new(),
        relays,
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
                                data: big,
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
            self.budget.below(CONN_APPEND_QUEUE_BYTES_MAX).await;
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
        match frame.op {
            Op::APPEND => self.append(frame, body).await,
            Op::APPEND_CHUNK => self.append_chunk(frame, body),
            Op::READ => self.read(frame, body.raw()).await,
            Op::CANCEL => {
                if let Some(&k) = self.forwarded.get(&id) {
                    self.forward(k, body.raw()).await;
                } else if let Some(c) = self.reads.borrow().get(&id) {
                    c.cancel();
                }
            }
            Op::PING => self
                .outbox
                .frame(Op::PONG, Status::OK, id, &[], frame.payload),
            Op::ROUTE => match wire::decode_name(frame.meta) {
                Ok(name) => {
                    let shard = rotary_net::shard_of(name, self.shard.shards);
                    let body = serde_json::json!({
                        "journal": name,
                        "shard": shard,
                        "shards": self.shard.shards,
                        "endpoint": self.shard.endpoints[shard as usize].to_string(),
                    });
                    self.admin_ok(id, &body);
                }
                Err(e) => self.admin_err(id, e.status(), &e.to_string()),
            },
            Op::APPLY => self.apply(id, frame.payload),
            Op::LIST => self.list(id, frame.payload),
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
                self.admin_ok(id, &body);
            }
            Op::PRUNE => self.prune(id, frame.payload).await,
            Op::DELETE | Op::FRAGMENTS | Op::SEAL | Op::RESET_HEAD => {
                self.by_name(frame, body.raw()).await
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
            return self.refuse_append(
                &frame,
                Status::BAD_REQUEST,
                "request id already in use by an open append",
            );
        }
        let owner = rotary_net::shard_of(&req.journal, self.shard.shards);
        if owner != self.shard.index {
            if frame.flags & flag::MORE != 0 {
                self.forwarded.insert(id, owner);
            }
            return self.forward(owner, raw).await;
        }
        if self.shard.shutting_down.get() {
            return self.refuse_append(&frame, Status::SHUTTING_DOWN, "broker is shutting down");
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            return self.refuse_append(
                &frame,
                Status::JOURNAL_NOT_FOUND,
                &format!("journal {:?} does not exist", req.journal),
            );
        };
        if j.borrow().spec.flags == JournalFlags::ReadOnly {
            return self.refuse_append(&frame, Status::NOT_ALLOWED, "journal is read-only");
        }
        let wait = self.shard.throttle(&j, body.payload(&frame).len() as u64);
        if !wait.is_zero() {
            compio::time::sleep(wait).await;
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
                data: frame.payload.to_vec(),
                range: 0..frame.payload.len(),
            },
        };
        if chunk.range.is_empty() {
            return;
        }
        self.budget.charge(chunk.range.len());
        op.chunks.borrow_mut().push_back(chunk);
    }

    fn append_chunk(&mut self, frame: Frame<'_>, body: Body<'_>) {
        let id = frame.request_id;
        let more = frame.flags & flag::MORE != 0;
        if self.discard.contains(&id) {
            if !more {
                self.discard.remove(&id);
            }
            return;
        }
        if let Some(&k) = self.forwarded.get(&id) {
            if !more {
                self.forwarded.remove(&id);
            }
            // Forwarding is async only while connecting; chunks follow an
            // APPEND that already connected the relay.
            if let Some(relay) = &self.relays[k as usize] {
                relay.raw(body.raw());
            }
            return;
        }
        let Some((op, j)) = self.appends.get(&id).cloned() else {
            self.append_error(
                id,
                Status::BAD_REQUEST,
                "APPEND_CHUNK without an open append of this request id",
            );
            if more {
                self.discard.insert(id);
            }
            return;
        };
        if !more {
            self.appends.remove(&id);
        }
        if op.finished.get() {
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
            self.forwarded.insert(id, owner);
            return self.forward(owner, raw).await;
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            let msg = format!("journal {:?} does not exist", req.journal);
            return self
                .outbox
                .error(Op::READ_DONE, Status::JOURNAL_NOT_FOUND, id, &[0; 16], &msg);
        };
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

    fn apply(&self, id: u64, payload: &[u8]) {
        let specs: Vec<JournalSpec> = match serde_json::from_slice(payload) {
            Ok(s) => s,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &format!("specs: {e}")),
        };
        for s in &specs {
            if let Err(e) = s.validate() {
                return self.admin_err(id, Status::BAD_REQUEST, &e.to_string());
            }
        }
        match self.shard.specs.apply(specs) {
            Ok(n) => self.admin_ok(id, &serde_json::json!({ "applied": n })),
            Err(e) => self.admin_err(id, Status::IO_ERROR, &e.to_string()),
        }
    }

    fn list(&self, id: u64, payload: &[u8]) {
        let sel = match SelectorRequest::parse(payload, "list") {
            Ok(r) => r.selector,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        let out: Vec<serde_json::Value> = self
            .shard
            .specs
            .all()
            .into_iter()
            .filter(|s| sel.matches(&s.labels))
            .map(|s| {
                let shard = rotary_net::shard_of(&s.name, self.shard.shards);
                serde_json::json!({
                    "spec": s,
                    "route": { "shard": shard, "endpoint": self.shard.endpoints[shard as usize].to_string() },
                })
            })
            .collect();
        self.admin_ok(id, &serde_json::Value::Array(out));
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
            return self.forward(owner, raw).await;
        }
        let not_found = format!("journal {name:?} does not exist");
        match frame.op {
            Op::DELETE => match self.shard.delete_journal(&name) {
                Ok(true) => self.admin_ok(id, &serde_json::json!({ "deleted": name })),
                Ok(false) => self.admin_err(id, Status::JOURNAL_NOT_FOUND, &not_found),
                Err(e) => self.admin_err(id, Status::IO_ERROR, &e.to_string()),
            },
            op => {
                let Some(j) = self.shard.journal(&name) else {
                    return self.admin_err(id, Status::JOURNAL_NOT_FOUND, &not_found);
                };
                match op {
                    Op::FRAGMENTS => {
                        let body = self.shard.fragments_json(&j);
                        self.admin_ok(id, &body);
                    }
                    Op::RESET_HEAD => self.shard.request_reset_head(&j, self.outbox.clone(), id),
                    Op::SEAL => self.shard.request_seal(&j, self.outbox.clone(), id),
                    _ => unreachable!("by_name handles DELETE, FRAGMENTS, SEAL, RESET_HEAD"),
                }
            }
        }
    }

    /// Sends a raw request frame to shard `k` over this connection's relay.
    async fn forward(&mut self, k: u32, raw: &[u8]) {
        metrics::add(&self.shard.metrics.cross_core_forwards, 1);
        if self.relays[k as usize].is_none() {
            let addr = self.shard.endpoints[k as usize];
            let stream = match TcpStream::connect(addr).await {
                Ok(s) => s,
                Err(e) => {
                    let id = header_request_id(raw);
                    self.outbox.error(
                        Op::ERROR,
                        Status::IO_ERROR,
                        id,
                        &[],
                        &format!("forwarding to shard {k}: {e}"),
                    );
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let (rd, wr) = stream.into_split();
            let relay = Rc::new(Outbox::new());
            compio::runtime::spawn(outbox::writer(wr, relay.clone())).detach();
            compio::runtime::spawn(pump(rd, self.outbox.clone(), relay.clone())).detach();
            self.relays[k as usize] = Some(relay);
        }
        if let Some(relay) = &self.relays[k as usize] {
            relay.raw(raw);
        }
    }

    fn close(&mut self) {
        for (_, (op, j)) in self.appends.drain() {
            op.aborted.set(Some(AbortReason::Closed));
            self.shard.mark_ready(&j);
        }
        for c in self.reads.borrow().values() {
            c.cancel();
        }
        for r in self.relays.iter().flatten() {
            r.close();
        }
        self.outbox.close();
    }
}

/// The JSON payload of LIST and PRUNE: `{"selector": "…", "dry_run": bool}`,
/// every field optional, an empty payload meaning `{}`.
struct SelectorRequest {
    selector: LabelSelector,
    dry_run: bool,
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
        }
        let raw: Raw = if payload.is_empty() {
            Raw::default()
        } else {
            serde_json::from_slice(payload).map_err(|e| format!("{what}: {e}"))?
        };
        let selector = LabelSelector::parse(&raw.selector).map_err(|e| e.to_string())?;
        Ok(SelectorRequest {
            selector,
            dry_run: raw.dry_run,
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

/// Copies whole reply frames from a relay connection to the client.
async fn pump(mut rd: TcpStream, client: Rc<Outbox>, relay: Rc<Outbox>) {
    let mut buf: Vec<u8> = Vec::with_capacity(READ_BUFFER_BYTES);
    loop {
        let mut start = 0;
        while let Ok(Some((_, total))) = wire::decode_header(&buf[start..], u32::MAX) {
            if buf.len() - start < total {
                break;
            }
            client.raw(&buf[start..start + total]);
            start += total;
        }
        buf.drain(..start);
        if buf.capacity() - buf.len() < READ_BUFFER_BYTES / 4 {
            buf.reserve(READ_BUFFER_BYTES);
        }
        if client.is_closed() {
            break;
        }
        let BufResult(res, b) = rd.read(buf.uninit()).await;
        buf = b.into_inner();
        match res {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        client.room().await;
    }
    relay.close();
}
