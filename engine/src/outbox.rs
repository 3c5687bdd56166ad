//! A connection's outgoing bytes. Producers (request handlers, the
//! flusher, relays) append whole frames; one writer task drains them to the
//! socket, many frames per syscall. Shard-local (`!Send`).

use event_listener::Event;
use rotary_net::status::Status;
use rotary_net::wire::{self, Op};
use std::cell::{Cell, RefCell};

/// Producers wait once this many bytes are queued.
pub const OUTBOX_HIGH_WATER_BYTES: usize = 8 << 20;

#[derive(Default)]
pub struct Outbox {
    buf: RefCell<Vec<u8>>,
    /// Wakes the writer.
    pub(crate) filled: Event,
    /// Wakes producers waiting for room.
    pub(crate) drained: Event,
    closed: Cell<bool>,
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
    }

    pub fn frame(&self, op: Op, status: Status, request_id: u64, meta: &[u8], payload: &[u8]) {
        if self.closed.get() {
            return;
        }
        wire::encode_frame(
            &mut self.buf.borrow_mut(),
            op,
            0,
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

    /// Waits until the queue is below the high-water mark (or closed).
    pub async fn room(&self) {
        loop {
            if self.closed.get() || self.queued() < OUTBOX_HIGH_WATER_BYTES {
                return;
            }
            let l = self.drained.listen();
            if self.closed.get() || self.queued() < OUTBOX_HIGH_WATER_BYTES {
                return;
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
        outbox.drained.notify(usize::MAX);
        let BufResult(res, mut bytes) = stream.write_all(bytes).await;
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
