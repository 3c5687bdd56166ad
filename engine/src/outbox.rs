//! A connection's outgoing bytes. Producers (request handlers, the
//! flusher, relays) append whole frames; one writer task drains them to the
//! socket, many frames per syscall. Shard-local (`!Send`).

use event_listener::Event;
use rotary_net::status::Status;
use rotary_net::wire::{self, Op};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// Producers wait once this many bytes are queued or being written: a
/// client that stops reading holds at most about this much of the broker's
/// memory per connection, plus one chunk per producing read.
pub const OUTBOX_HIGH_WATER_BYTES: usize = 4 << 20;
/// A connection's requests are not read on while this much of its replies
/// is queued or being written: a client that sends requests and never
/// reads their replies stalls itself, not the broker's memory.
pub const OUTBOX_REQUESTS_PAUSE_BYTES: usize = 2 * OUTBOX_HIGH_WATER_BYTES;
/// Reads of one connection that may produce a chunk at once. Reads beyond
/// these wait for a turn before they read from disk, so a connection with
/// thousands of reads in flight does not hold a chunk for each.
pub const OUTBOX_PRODUCERS_MAX: usize = 2;

#[derive(Default)]
pub struct Outbox {
    buf: RefCell<Vec<u8>>,
    /// Bytes the writer took and is still writing.
    writing: Cell<usize>,
    /// Reads holding a [`Producing`] turn.
    producing: Cell<usize>,
    /// Wakes the writer.
    pub(crate) filled: Event,
    /// Wakes producers waiting for room (and, on close, everyone).
    pub(crate) drained: Event,
    /// Wakes reads waiting for a producing turn.
    turn: Event,
    /// Notified once, on close: for tasks that wait for something else and
    /// must also stop when the connection goes.
    pub(crate) closing: Event,
    closed: Cell<bool>,
    /// Replies owed and not queued yet ([`Outbox::promise`]).
    promised: Cell<usize>,
}

/// A reply owed on an outbox; a clean stop waits for it. Queue the reply,
/// then drop this.
pub struct Promise(Rc<Outbox>);

impl Drop for Promise {
    fn drop(&mut self) {
        self.0.promised.set(self.0.promised.get() - 1);
    }
}

/// A read's turn to produce one chunk into the outbox; ends when dropped.
pub struct Producing<'a> {
    outbox: &'a Outbox,
}

impl Drop for Producing<'_> {
    fn drop(&mut self) {
        self.outbox.producing.set(self.outbox.producing.get() - 1);
        self.outbox.turn.notify(1);
    }
}

impl Outbox {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    pub fn close(&self) {
        self.closed.set(true);
        self.filled.notify(usize::MAX);
        self.drained.notify(usize::MAX);
        self.turn.notify(usize::MAX);
        self.closing.notify(usize::MAX);
    }

    pub fn frame(&self, op: Op, status: Status, request_id: u64, meta: &[u8], payload: &[u8]) {
        self.flagged_frame(op, 0, status, request_id, meta, payload);
    }

    /// As [`Outbox::frame`], with flag bits the op defines.
    pub fn flagged_frame(
        &self,
        op: Op,
        flags: u8,
        status: Status,
        request_id: u64,
        meta: &[u8],
        payload: &[u8],
    ) {
        if self.closed.get() {
            return;
        }
        wire::encode_frame(
            &mut self.buf.borrow_mut(),
            op,
            flags,
            status,
            request_id,
            meta,
            payload,
        );
        self.filled.notify(1);
    }

    /// Raw, already-framed bytes (from a relay).
    pub fn raw(&self, bytes: &[u8]) {
        if self.closed.get() {
            return;
        }
        self.buf.borrow_mut().extend_from_slice(bytes);
        self.filled.notify(1);
    }

    /// Whole frames already encoded in a buffer of their own: taken over
    /// without a copy when nothing else is queued.
    pub fn raw_owned(&self, bytes: Vec<u8>) {
        if self.closed.get() {
            return;
        }
        let mut buf = self.buf.borrow_mut();
        if buf.is_empty() {
            *buf = bytes;
        } else {
            buf.extend_from_slice(&bytes);
        }
        drop(buf);
        self.filled.notify(1);
    }

    /// An error reply: the message travels as the payload.
    pub fn error(&self, op: Op, status: Status, request_id: u64, meta: &[u8], message: &str) {
        self.frame(op, status, request_id, meta, message.as_bytes());
    }

    pub fn queued(&self) -> usize {
        self.buf.borrow().len()
    }

    /// Marks a reply that will be queued later (its content is not ready),
    /// until the returned promise is dropped.
    pub fn promise(self: &Rc<Self>) -> Promise {
        self.promised.set(self.promised.get() + 1);
        Promise(self.clone())
    }

    /// Replies promised and not queued yet.
    pub fn promised(&self) -> usize {
        self.promised.get()
    }

    /// Bytes queued or being written.
    pub fn backlog(&self) -> usize {
        self.queued() + self.writing.get()
    }

    /// Waits until the backlog is below the high-water mark (or closed).
    pub async fn room(&self) {
        self.below(OUTBOX_HIGH_WATER_BYTES).await;
    }

    /// Waits until the backlog is below `limit` bytes (or closed).
    pub async fn below(&self, limit: usize) {
        loop {
            if self.closed.get() || self.backlog() < limit {
                return;
            }
            let l = self.drained.listen();
            if self.closed.get() || self.backlog() < limit {
                return;
            }
            l.await;
        }
    }

    /// Waits for room and a producing turn, for a read about to fetch and
    /// queue one chunk. None once the outbox is closed.
    pub async fn produce(&self) -> Option<Producing<'_>> {
        loop {
            self.room().await;
            if self.closed.get() {
                return None;
            }
            if self.producing.get() < OUTBOX_PRODUCERS_MAX {
                self.producing.set(self.producing.get() + 1);
                return Some(Producing { outbox: self });
            }
            let l = self.turn.listen();
            if self.closed.get() || self.producing.get() < OUTBOX_PRODUCERS_MAX {
                continue;
            }
            l.await;
        }
    }

    /// Swaps out everything queued (for the writer).
    pub(crate) fn take(&self, spare: Vec<u8>) -> Vec<u8> {
        std::mem::replace(&mut self.buf.borrow_mut(), spare)
    }
}

/// Drains `outbox` into `stream` until the outbox closes or a write fails.
pub async fn writer<W: compio::io::AsyncWrite>(mut stream: W, outbox: std::rc::Rc<Outbox>) {
    use compio::buf::BufResult;
    use compio::io::AsyncWriteExt;
    let mut spare = Vec::with_capacity(64 << 10);
    loop {
        if outbox.queued() == 0 {
            if outbox.is_closed() {
                break;
            }
            let l = outbox.filled.listen();
            if outbox.queued() == 0 && !outbox.is_closed() {
                l.await;
            }
            continue;
        }
        let bytes = outbox.take(spare);
        outbox.writing.set(bytes.len());
        let BufResult(res, mut bytes) = stream.write_all(bytes).await;
        outbox.writing.set(0);
        outbox.drained.notify(usize::MAX);
        if res.is_err() {
            outbox.close();
            break;
        }
        bytes.clear();
        if bytes.capacity() > (16 << 20) {
            bytes = Vec::with_capacity(64 << 10);
        }
        spare = bytes;
    }
    let _ = stream.shutdown().await;
}
