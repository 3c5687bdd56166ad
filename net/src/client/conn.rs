//! One multiplexed TCP connection to one shard endpoint.
//!
//! A connection owns two tokio tasks. The *writer* drains an unbounded queue
//! of frames and writes whatever is queued with few vectored writes (small
//! frames are copied into one staging buffer, large payloads go out as their
//! own `Bytes` without a copy). The *reader* decodes reply frames and hands
//! each to the request waiting on its `request_id`.
//!
//! Memory is bounded in both directions: queued request bytes are limited by
//! a semaphore of [`WRITE_QUEUE_BYTES_MAX`] (control frames such as CANCEL
//! and ABORT bypass it, they are tiny and must be sendable from `Drop`), and
//! each read stream buffers at most [`READ_FRAMES_BUFFERED_MAX`] frames —
//! beyond that the reader task waits, which stops reading the socket and lets
//! TCP push back on the broker.

use super::{ClientError, ProtocolError};
use crate::status::Status;
use crate::wire::{self, Op};
use bytes::{Buf, Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

/// Request bytes queued for the writer but not yet written, per connection.
pub const WRITE_QUEUE_BYTES_MAX: usize = 32 << 20;
/// Reply frames a read stream buffers before the connection's reader waits.
pub const READ_FRAMES_BUFFERED_MAX: usize = 32;
/// Largest reply body the client accepts (LIST replies can be large).
pub const REPLY_BODY_LEN_MAX: u32 = 256 << 20;
/// How long opening a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes the writer gathers before it writes.
const WRITE_BATCH_BYTES_MAX: usize = 4 << 20;
/// Payloads up to this size are copied into the staging buffer; larger ones
/// are written from their own buffer.
const PAYLOAD_COPY_LEN_MAX: usize = 16 << 10;
/// Slices handed to one `writev`.
const WRITE_SLICES_MAX: usize = 64;
/// Free space the reader keeps in its buffer before each read.
const READ_BUFFER_SPARE_MIN: usize = 64 << 10;
/// How long a connection with requests waiting may hear nothing from its
/// broker before the client sends it a PING; after as long again with
/// still nothing, the connection is given up (see [`Conn::open`]).
pub const SILENCE_DEFAULT: Duration = Duration::from_secs(15);
/// Request id of the reader's PINGs. Requests count up from 1 and never
/// reach it, so its PONG finds no waiter and is dropped.
const PROBE_ID: u64 = u64::MAX;

const _: () = assert!(WRITE_QUEUE_BYTES_MAX <= Semaphore::MAX_PERMITS);
const _: () = assert!(WRITE_QUEUE_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(REPLY_BODY_LEN_MAX >= wire::BODY_LEN_MAX);

/// A reply frame, sliced out of the read buffer without a copy.
#[derive(Debug)]
pub(crate) struct Reply {
    pub op: Op,
    /// The frame's flag bits (checked against the op's by decode_header).
    pub flags: u8,
    pub status: Status,
    pub meta: Bytes,
    pub payload: Bytes,
}

impl Reply {
    /// The error message a non-OK reply carries.
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

/// Who waits for the replies to a request id.
pub(crate) enum Waiter {
    /// Exactly one reply frame (APPEND, admin requests, PING).
    Once(oneshot::Sender<Result<Reply, ClientError>>),
    /// READ_DATA and READ_FRAGMENT frames then one READ_DONE (or ERROR).
    Stream(mpsc::Sender<Result<Reply, ClientError>>),
}

/// Why a connection is unusable. Cloned into every waiter's error.
#[derive(Clone, Debug)]
enum Closed {
    Io(Arc<io::Error>),
    Protocol(ProtocolError),
}

#[derive(Default)]
struct State {
    pending: HashMap<u64, Waiter>,
    closed: Option<Closed>,
}

/// State shared by the connection handle and its two tasks.
struct Shared {
    endpoint: String,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock is a bug in this module; the state
        // it guards is still consistent (single map operations), so go on.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, closed: &Closed) -> ClientError {
        match closed {
            Closed::Io(e) => ClientError::Io {
                endpoint: self.endpoint.clone(),
                source: e.clone(),
            },
            Closed::Protocol(e) => ClientError::Protocol {
                endpoint: self.endpoint.clone(),
                source: e.clone(),
            },
        }
    }

    /// Marks the connection unusable and fails every request in flight.
    fn close(&self, why: Closed) {
        let pending = {
            let mut st = self.lock();
            if st.closed.is_none() {
                st.closed = Some(why.clone());
            }
            std::mem::take(&mut st.pending)
        };
        for (_, waiter) in pending {
            match waiter {
                Waiter::Once(tx) => {
                    let _ = tx.send(Err(self.error(&why)));
                }
                // If the stream's buffer is full the error is dropped; the
                // stream then sees its channel close without READ_DONE and
                // reports the connection as lost.
                Waiter::Stream(tx) => {
                    let _ = tx.try_send(Err(self.error(&why)));
                }
            }
        }
    }
}

/// A frame queued for the writer.
struct Outgoing {
    header: wire::FrameHeader,
    meta: Bytes,
    payload: Bytes,
    _permit: Option<OwnedSemaphorePermit>,
}

/// A live connection. Dropping the last handle stops its tasks and closes
/// the socket.
pub(crate) struct Conn {
    pub endpoint: String,
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Outgoing>,
    budget: Arc<Semaphore>,
    next_id: AtomicU64,
    reader: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The writer ends by itself once `tx` is gone (flushing what is
        // queued, then shutting the socket down); the reader would wait for
        // the broker to close, so stop it here.
        self.reader.abort();
    }
}

impl Conn {
    /// Connects to `endpoint` and starts the reader and writer tasks.
    ///
    /// While requests wait on the connection, its reader expects to hear
    /// from the broker: after `silence` without a byte it sends a PING
    /// (a live broker answers it even while every request waits, e.g. a
    /// blocking read at the write head), and after `silence` more without
    /// a byte it closes the connection, failing every waiting request with
    /// a `TimedOut` I/O error. So a broker that stopped, hung or vanished
    /// from the network without a reset fails them within `2 × silence`.
    /// A reader held back by a slow consumer of a read stream is not
    /// reading the socket and is not counted as silence.
    pub async fn open(endpoint: &str, silence: Duration) -> Result<Arc<Conn>, ClientError> {
        let io_err = |e: io::Error| ClientError::Io {
            endpoint: endpoint.to_string(),
            source: Arc::new(e),
        };
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(endpoint)).await
        {
            Ok(r) => r.map_err(io_err)?,
            Err(_) => {
                return Err(io_err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connecting took longer than {CONNECT_TIMEOUT:?}"),
                )))
            }
        };
        stream.set_nodelay(true).map_err(io_err)?;
        let (rd, wr) = stream.into_split();
        let shared = Arc::new(Shared {
            endpoint: endpoint.to_string(),
            state: Mutex::new(State::default()),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let probe = tx.clone();
        tokio::spawn(write_loop(wr, rx, shared.clone()));
        let reader = tokio::spawn(read_loop(rd, shared.clone(), probe, silence));
        Ok(Arc::new(Conn {
            endpoint: endpoint.to_string(),
            shared,
            tx,
            budget: Arc::new(Semaphore::new(WRITE_QUEUE_BYTES_MAX)),
            next_id: AtomicU64::new(1),
            reader,
        }))
    }

    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed.is_some() || self.tx.is_closed()
    }

    fn closed_error(&self) -> ClientError {
        let st = self.shared.lock();
        match &st.closed {
            Some(c) => self.shared.error(c),
            None => self.shared.error(&Closed::Io(Arc::new(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection writer stopped",
            )))),
        }
    }

    /// Allocates a request id and registers who waits for its replies.
    pub fn register(&self, waiter: Waiter) -> Result<u64, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut st = self.shared.lock();
        if let Some(c) = &st.closed {
            return Err(self.shared.error(c));
        }
        let prev = st.pending.insert(id, waiter);
        assert!(prev.is_none(), "request id {id} reused");
        Ok(id)
    }

    /// Forgets a request: replies still arriving for it are dropped.
    pub fn unregister(&self, id: u64) {
        self.shared.lock().pending.remove(&id);
    }

    /// Error for a waiter whose sender vanished (the connection closed).
    pub fn lost(&self) -> ClientError {
        self.closed_error()
    }

    /// Queues a request frame, waiting while the write queue is full.
    pub async fn send(
        &self,
        op: Op,
        flags: u8,
        id: u64,
        meta: Bytes,
        payload: Bytes,
    ) -> Result<(), ClientError> {
        if self.shared.lock().closed.is_some() {
            return Err(self.closed_error());
        }
        let len = wire::HEADER_LEN + meta.len() + payload.len();
        let permits = len.min(WRITE_QUEUE_BYTES_MAX) as u32;
        let permit = self
            .budget
            .clone()
            .acquire_many_owned(permits)
            .await
            .expect("write budget semaphore is never closed");
        self.queue(op, flags, id, meta, payload, Some(permit))
    }

    /// Queues a small control frame (CANCEL, ABORT) at once, without
    /// waiting for queue space: callable from `Drop`. Errors are ignored
    /// because a closed connection has nothing left to cancel.
    pub fn send_control(&self, op: Op, flags: u8, id: u64) {
        let _ = self.queue(op, flags, id, Bytes::new(), Bytes::new(), None);
    }

    fn queue(
        &self,
        op: Op,
        flags: u8,
        id: u64,
        meta: Bytes,
        payload: Bytes,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ClientError> {
        let header = wire::frame_header(op, flags, Status::OK, id, meta.len(), payload.len());
        self.tx
            .send(Outgoing {
                header,
                meta,
                payload,
                _permit: permit,
            })
            .map_err(|_| self.closed_error())
    }
}

async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    shared: Arc<Shared>,
) {
    use zerocopy::IntoBytes;
    let mut staging = BytesMut::new();
    let mut segments: VecDeque<Bytes> = VecDeque::new();
    let mut written: Vec<Outgoing> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut batch_len = 0usize;
        let mut next = Some(first);
        while let Some(out) = next.take() {
            batch_len += wire::HEADER_LEN + out.meta.len() + out.payload.len();
            staging.extend_from_slice(out.header.as_bytes());
            staging.extend_from_slice(&out.meta);
            if out.payload.len() <= PAYLOAD_COPY_LEN_MAX {
                staging.extend_from_slice(&out.payload);
            } else {
                segments.push_back(staging.split().freeze());
                segments.push_back(out.payload.clone());
            }
            // Keep the permit until the bytes are written.
            written.push(out);
            if batch_len < WRITE_BATCH_BYTES_MAX {
                next = rx.try_recv().ok();
            }
        }
        if !staging.is_empty() {
            segments.push_back(staging.split().freeze());
        }
        if let Err(e) = write_segments(&mut wr, &mut segments).await {
            shared.close(Closed::Io(Arc::new(e)));
            return;
        }
        written.clear();
    }
    // Every handle is gone: nothing more will be sent.
    let _ = wr.shutdown().await;
}

/// Writes every segment, as few `writev` calls as the socket allows.
async fn write_segments(wr: &mut OwnedWriteHalf, segments: &mut VecDeque<Bytes>) -> io::Result<()> {
    while !segments.is_empty() {
        let n = {
            let slices: Vec<IoSlice<'_>> = segments
                .iter()
                .take(WRITE_SLICES_MAX)
                .map(|s| IoSlice::new(s))
                .collect();
            wr.write_vectored(&slices).await?
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "socket accepted no bytes",
            ));
        }
        let mut left = n;
        while left > 0 {
            let front = segments.front_mut().expect("wrote more than was queued");
            if left >= front.len() {
                left -= front.len();
                segments.pop_front();
            } else {
                front.advance(left);
                left = 0;
            }
        }
    }
    Ok(())
}

async fn read_loop(
    mut rd: OwnedReadHalf,
    shared: Arc<Shared>,
    probe: mpsc::UnboundedSender<Outgoing>,
    silence: Duration,
) {
    let mut buf = BytesMut::with_capacity(READ_BUFFER_SPARE_MIN);
    // Whether a PING went out since the last byte came in.
    let mut probed = false;
    let why = loop {
        match wire::decode_header(&buf, REPLY_BODY_LEN_MAX) {
            Err(e) => break Closed::Protocol(ProtocolError::Wire(e)),
            Ok(Some((header, total))) if buf.len() >= total => {
                let frame = buf.split_to(total).freeze();
                dispatch(&shared, header, frame).await;
                continue;
            }
            Ok(Some((_, total))) => {
                let want = (total - buf.len()).max(READ_BUFFER_SPARE_MIN);
                buf.reserve(want);
            }
            Ok(None) => buf.reserve(READ_BUFFER_SPARE_MIN),
        }
        // `read_buf` is cancel-safe: a read that times out took no bytes.
        let read = match tokio::time::timeout(silence, rd.read_buf(&mut buf)).await {
            Ok(read) => read,
            Err(_) if shared.lock().pending.is_empty() => continue,
            Err(_) if probed => {
                break Closed::Io(Arc::new(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the broker sent nothing for {:?} while requests waited, \
                         not even an answer to a PING",
                        silence * 2
                    ),
                )))
            }
            Err(_) => {
                probed = true;
                let header = wire::frame_header(Op::PING, 0, Status::OK, PROBE_ID, 0, 0);
                let _ = probe.send(Outgoing {
                    header,
                    meta: Bytes::new(),
                    payload: Bytes::new(),
                    _permit: None,
                });
                continue;
            }
        };
        probed = false;
        match read {
            Ok(0) => {
                break Closed::Io(Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the broker closed the connection",
                )))
            }
            Ok(_) => {}
            Err(e) => break Closed::Io(Arc::new(e)),
        }
    };
    shared.close(why);
}

/// Hands one reply frame to whoever waits for its request id.
async fn dispatch(shared: &Shared, header: wire::FrameHeader, frame: Bytes) {
    let id = header.request_id.get();
    // decode_header checked the op.
    let op = Op::from_code(header.op).expect("decode_header checks the op");
    let meta_end = wire::HEADER_LEN + header.meta_len.get() as usize;
    let code = header.status.get();
    let reply = match Status::from_code(code) {
        Some(status) => Ok(Reply {
            op,
            flags: header.flags,
            status,
            meta: frame.slice(wire::HEADER_LEN..meta_end),
            payload: frame.slice(meta_end..),
        }),
        None => Err(ClientError::Protocol {
            endpoint: shared.endpoint.clone(),
            source: ProtocolError::Wire(wire::WireError::UnknownStatus(code)),
        }),
    };
    // READ_DATA and READ_FRAGMENT are the replies that are not the last for
    // their request (a READ_DONE follows).
    let last = !matches!(op, Op::READ_DATA | Op::READ_FRAGMENT) || reply.is_err();
    let waiter = {
        let mut st = shared.lock();
        match st.pending.get(&id) {
            None => None,
            Some(Waiter::Stream(tx)) if !last => Some(Waiter::Stream(tx.clone())),
            Some(_) => st.pending.remove(&id),
        }
    };
    match waiter {
        // A request the caller gave up on (a cancelled read, an abandoned
        // append): its late replies are dropped.
        None => {}
        Some(Waiter::Once(tx)) => {
            let _ = tx.send(reply);
        }
        Some(Waiter::Stream(tx)) => {
            let _ = tx.send(reply).await;
        }
    }
}
