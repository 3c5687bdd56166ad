//! The primary side of replication: one long-lived connection from a
//! primary shard to each peer shard, shared by every journal routed that
//! way, and the acknowledgements that come back on it.
//!
//! The flusher buffers records ([`Pipeline::push`]) while it stages a turn
//! and sends them as one REPLICATE frame per peer ([`Pipeline::flush`]).
//! Acks come back in REPLICATE_ACK frames, many per frame; waiters find
//! theirs by sequence number. A broken connection fails every waiter at
//! once and bumps the pipeline's epoch, so journals synchronized over the
//! old connection know to synchronize again.

use crate::outbox::{self, Outbox};
use compio::buf::{BufResult, IntoInner, IoBufMut};
use compio::io::AsyncRead;
use compio::net::TcpStream;
use event_listener::Event;
use rotary_net::repl::{self, Ack, Record};
use rotary_net::status::Status;
use rotary_net::wire::{self, MetaWriter, Op};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

/// How long a primary waits for a replica's ack before it gives the
/// pipeline up, unless configured (`rotary serve --replica-ack-timeout`).
pub const ACK_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// A REPLICATE frame is sent once its records reach this many bytes (one
/// content record is at most a spool write buffer).
pub const REPLICATE_FRAME_BYTES: usize = 4 << 20;
/// Acks kept for waiters before the oldest are dropped.
const UNCLAIMED_ACKS_MAX: usize = 65_536;
/// How long connecting to a peer may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a replicated step failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub status: Status,
    pub message: String,
    /// The peer did not answer in time (rather than refuse, or close).
    pub timed_out: bool,
}

impl Failure {
    pub fn new(status: Status, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
            timed_out: false,
        }
    }

    /// A peer that did not answer (connect, or ack) in time.
    pub fn timed_out(message: impl Into<String>) -> Failure {
        Failure {
            timed_out: true,
            ..Failure::new(Status::REPLICATION_FAILED, message)
        }
    }
}

pub struct Pipeline {
    /// The peer broker's id.
    pub peer: String,
    /// The peer shard's endpoint.
    pub addr: SocketAddr,
    outbox: RefCell<Option<Rc<Outbox>>>,
    /// Bumped on every new connection.
    epoch: Cell<u64>,
    connecting: Cell<bool>,
    connected: Event,
    /// Acks received and not yet taken, by seq.
    acks: RefCell<BTreeMap<u64, Ack>>,
    /// Waiters by the seq each waits for: an ack wakes only its own
    /// waiter (every journal with batches in flight waits on the pipelines
    /// of its replicas at once), a broken connection wakes them all.
    waiters: RefCell<HashMap<u64, Rc<Event>>>,
    /// Seqs whose acks nobody will take (their batch failed on another
    /// replica): dropped as they arrive. Cleared with each new connection.
    forgotten: RefCell<HashSet<u64>>,
    /// Records buffered for the next REPLICATE frame.
    pending: RefCell<MetaWriter>,
    pending_records: Cell<usize>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// How long an ack may take before the replica is treated as gone.
    ack_timeout: Duration,
}

impl Pipeline {
    pub fn new(
        peer: String,
        addr: SocketAddr,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        ack_timeout: Duration,
    ) -> Rc<Pipeline> {
        Rc::new(Pipeline {
            peer,
            addr,
            outbox: RefCell::new(None),
            epoch: Cell::new(0),
            connecting: Cell::new(false),
            connected: Event::new(),
            acks: RefCell::new(BTreeMap::new()),
            waiters: RefCell::new(HashMap::new()),
            forgotten: RefCell::new(HashSet::new()),
            pending: RefCell::new(frame_buffer()),
            pending_records: Cell::new(0),
            metrics,
            ack_timeout,
        })
    }

    /// The current connection's epoch, if connected.
    pub fn live_epoch(&self) -> Option<u64> {
        self.outbox
            .borrow()
            .as_ref()
            .filter(|o| !o.is_closed())
            .map(|_| self.epoch.get())
    }

    /// Connects if there is no live connection; returns its epoch.
    pub async fn connect(self: &Rc<Self>) -> Result<u64, Failure> {
        loop {
            if let Some(e) = self.live_epoch() {
                return Ok(e);
            }
            if self.connecting.get() {
                let l = self.connected.listen();
                if self.connecting.get() {
                    l.await;
                }
                continue;
            }
            self.connecting.set(true);
            let res = compio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(self.addr)).await;
            self.connecting.set(false);
            self.connected.notify(usize::MAX);
            let stream = match res {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(Failure::new(
                        Status::REPLICATION_FAILED,
                        format!("replica {} at {}: {e}", self.peer, self.addr),
                    ))
                }
                Err(_) => {
                    return Err(Failure::timed_out(format!(
                        "replica {} at {}: connect timed out",
                        self.peer, self.addr
                    )))
                }
            };
            let _ = stream.set_nodelay(true);
            let (rd, wr) = stream.into_split();
            let ob = Rc::new(Outbox::new());
            compio::runtime::spawn(outbox::writer(wr, ob.clone())).detach();
            self.epoch.set(self.epoch.get() + 1);
            self.forgotten.borrow_mut().clear();
            // Records buffered for the old connection are meaningless now.
            *self.pending.borrow_mut() = frame_buffer();
            self.pending_records.set(0);
            *self.outbox.borrow_mut() = Some(ob.clone());
            compio::runtime::spawn(self.clone().read_acks(rd, ob, self.epoch.get())).detach();
            tracing::debug!(peer = %self.peer, addr = %self.addr, epoch = self.epoch.get(), "pipeline connected");
        }
    }

    /// Buffers a record for the next [`Pipeline::flush`]; dropped if the
    /// connection is gone (the journal will synchronize again).
    pub fn push(&self, rec: &Record<'_>) {
        if self.live_epoch().is_none() {
            return;
        }
        if self.pending.borrow().len() >= wire::HEADER_LEN + REPLICATE_FRAME_BYTES {
            // Frames stay well under the receiver's limit; order is kept.
            self.flush();
        }
        rec.encode(&mut self.pending.borrow_mut());
        self.pending_records.set(self.pending_records.get() + 1);
    }

    /// Sends the buffered records as one REPLICATE frame. The records were
    /// encoded after room for the frame header, so the buffer goes to the
    /// connection as it is.
    pub fn flush(&self) {
        if self.pending_records.get() == 0 {
            return;
        }
        self.pending_records.set(0);
        let mut frame =
            std::mem::replace(&mut *self.pending.borrow_mut(), frame_buffer()).into_payload();
        let header = wire::frame_header(
            Op::REPLICATE,
            0,
            Status::OK,
            0,
            0,
            frame.len() - wire::HEADER_LEN,
        );
        frame[..wire::HEADER_LEN].copy_from_slice(zerocopy::IntoBytes::as_bytes(&header));
        if let Some(ob) = self.outbox.borrow().as_ref() {
            ob.raw_owned(frame);
        }
    }

    /// Sends SYNC and waits for its answer.
    pub async fn sync(&self, req: &repl::SyncRequest) -> Result<Ack, Failure> {
        let epoch = self.live_epoch().ok_or_else(|| self.broken_failure())?;
        let body = serde_json::to_vec(req).expect("json");
        if let Some(ob) = self.outbox.borrow().as_ref() {
            ob.frame(Op::SYNC, Status::OK, req.seq, &[], &body);
        }
        self.wait(req.seq, epoch).await
    }

    fn broken_failure(&self) -> Failure {
        Failure::new(
            Status::REPLICATION_FAILED,
            format!(
                "connection to replica {} at {} is broken",
                self.peer, self.addr
            ),
        )
    }

    /// Waits for the ack of `seq` on the connection of `epoch`.
    pub async fn wait(&self, seq: u64, epoch: u64) -> Result<Ack, Failure> {
        if let Some(ack) = self.take(seq) {
            return Ok(ack);
        }
        let deadline = crate::clock::now() + self.ack_timeout;
        let event = Rc::new(Event::new());
        self.waiters.borrow_mut().insert(seq, event.clone());
        let _waiting = Waiting {
            pipeline: self,
            seq,
        };
        loop {
            let l = event.listen();
            if let Some(ack) = self.take(seq) {
                return Ok(ack);
            }
            if self.live_epoch() != Some(epoch) {
                return Err(self.broken_failure());
            }
            let left = deadline.saturating_duration_since(crate::clock::now());
            if left.is_zero() || compio::time::timeout(left, l).await.is_err() {
                // A replica that stops answering is treated as gone.
                tracing::warn!(peer = %self.peer, seq, "no ack from replica in time; closing the pipeline");
                self.close();
                return Err(Failure::timed_out(format!(
                    "replica {} did not acknowledge within {:?}",
                    self.peer, self.ack_timeout
                )));
            }
        }
    }

    /// Keeps acks until their waiters take them, and wakes those waiting.
    fn receive(&self, acks: Vec<Ack>) {
        let mut map = self.acks.borrow_mut();
        let mut forgotten = self.forgotten.borrow_mut();
        let waiters = self.waiters.borrow();
        for a in acks {
            if forgotten.remove(&a.seq) {
                continue;
            }
            if let Some(e) = waiters.get(&a.seq) {
                e.notify(1);
            }
            // The first answer for a seq stands.
            map.entry(a.seq).or_insert(a);
        }
    }

    /// Drops the ack of `seq`, sent on the connection of `epoch`, now or
    /// when it comes: its batch failed on another replica, and nobody will
    /// take it.
    /// The ack of `seq`, if it arrived already.
    pub fn try_take(&self, seq: u64) -> Option<Ack> {
        self.take(seq)
    }

    pub fn forget(&self, seq: u64, epoch: u64) {
        if self.acks.borrow_mut().remove(&seq).is_none() && self.live_epoch() == Some(epoch) {
            self.forgotten.borrow_mut().insert(seq);
        }
    }

    /// Takes the ack of `seq`. Waiters are not in seq order (each journal
    /// and each SYNC waits on its own), so acks are kept until taken or
    /// forgotten; the few nobody takes or forgets (a refusal of content
    /// whose commit was refused too) are dropped once many have piled up.
    fn take(&self, seq: u64) -> Option<Ack> {
        let mut acks = self.acks.borrow_mut();
        let ack = acks.remove(&seq)?;
        if acks.len() > UNCLAIMED_ACKS_MAX {
            let keep = acks.split_off(&seq);
            *acks = keep;
        }
        Some(ack)
    }

    pub fn close(&self) {
        if let Some(ob) = self.outbox.borrow_mut().take() {
            ob.close();
        }
        self.wake_all();
    }

    fn wake_all(&self) {
        for e in self.waiters.borrow().values() {
            e.notify(usize::MAX);
        }
    }

    async fn read_acks(self: Rc<Self>, mut rd: TcpStream, ob: Rc<Outbox>, epoch: u64) {
        let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
        'read: loop {
            let mut start = 0;
            loop {
                match wire::decode_frame(&buf[start..], wire::BODY_LEN_MAX) {
                    Ok(Some((f, used))) => {
                        if f.op == Op::REPLICATE_ACK {
                            match repl::decode_acks(f.payload) {
                                Ok(acks) => {
                                    crate::metrics::add(&self.metrics.repl_ack_frames, 1);
                                    crate::metrics::add(&self.metrics.repl_acks, acks.len() as u64);
                                    self.receive(acks);
                                }
                                Err(e) => {
                                    tracing::warn!(peer = %self.peer, error = %e, "bad ack frame");
                                    break 'read;
                                }
                            }
                        } else if f.status != Status::OK as u16 {
                            tracing::warn!(peer = %self.peer, op = ?f.op, status = f.status, message = %String::from_utf8_lossy(f.payload), "replica refused a frame");
                            break 'read;
                        }
                        start += used;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(peer = %self.peer, error = %e, "bad frame from replica");
                        break 'read;
                    }
                }
            }
            buf.drain(..start);
            if buf.capacity() - buf.len() < 16 << 10 {
                buf.reserve(64 << 10);
            }
            let BufResult(res, b) = rd.read(buf.uninit()).await;
            buf = b.into_inner();
            match res {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        ob.close();
        if self.epoch.get() == epoch {
            let mut cur = self.outbox.borrow_mut();
            if cur.as_ref().is_some_and(|o| Rc::ptr_eq(o, &ob)) {
                *cur = None;
            }
        }
        tracing::info!(peer = %self.peer, addr = %self.addr, "pipeline to replica closed");
        self.wake_all();
    }
}

/// A waiter's entry in [`Pipeline::waiters`], removed when its wait ends.
struct Waiting<'a> {
    pipeline: &'a Pipeline,
    seq: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.pipeline.waiters.borrow_mut().remove(&self.seq);
    }
}

/// A REPLICATE frame being built: room for the header, then records.
fn frame_buffer() -> MetaWriter {
    let mut w = MetaWriter::new();
    w.raw(&[0; wire::HEADER_LEN]);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(seq: u64) -> Ack {
        Ack {
            seq,
            status: Status::OK,
            body: Vec::new(),
        }
    }

    /// Acks of a failed batch's other seqs are dropped, whether they came
    /// before it failed or come after; the others are kept.
    #[test]
    fn forgotten_acks_are_dropped_before_and_after_they_come() {
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::default());
        let p = Pipeline::new(
            "b2".into(),
            "127.0.0.1:1".parse().unwrap(),
            metrics,
            ACK_TIMEOUT_DEFAULT,
        );
        *p.outbox.borrow_mut() = Some(Rc::new(Outbox::new()));
        let epoch = p.live_epoch().expect("live");
        p.receive(vec![ack(1), ack(2)]);
        p.forget(1, epoch);
        p.forget(3, epoch);
        p.receive(vec![ack(3), ack(4)]);
        assert!(p.take(1).is_none(), "forgotten after it came");
        assert!(p.take(3).is_none(), "forgotten before it came");
        assert_eq!(p.take(2).map(|a| a.seq), Some(2));
        assert_eq!(p.take(4).map(|a| a.seq), Some(4));
        assert!(p.acks.borrow().is_empty());
        assert!(p.forgotten.borrow().is_empty());
        // A seq forgotten on a connection that is gone leaves nothing behind.
        p.close();
        p.forget(5, epoch);
        assert!(p.forgotten.borrow().is_empty());
    }
}
