//! Response bodies, and request bodies read with a size limit and an idle
//! timeout.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use hyper::body::{Body as _, Frame, Incoming, SizeHint};

/// A response body: whole, or streamed from a channel (a GET's journal
/// bytes, sent as they arrive).
pub enum Body {
    Full(Option<Bytes>),
    Channel(tokio::sync::mpsc::Receiver<Bytes>),
}

impl Body {
    pub fn full(bytes: Bytes) -> Self {
        Body::Full(Some(bytes))
    }

    pub fn empty() -> Self {
        Body::Full(None)
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Channel(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Channel(_) => SizeHint::default(),
        }
    }
}

/// Why a request body could not be read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body exceeds the limit of {0} bytes")]
    TooLarge(u64),
    #[error("request body sent nothing for {0:?}")]
    Idle(Duration),
    #[error("reading the request body: {0}")]
    Broken(String),
}

impl BodyError {
    /// As the `io::Error` an `AsyncRead` returns, findable again by
    /// [`BodyError::from_io`].
    fn into_io(self) -> io::Error {
        io::Error::other(self)
    }

    pub fn from_io(e: &io::Error) -> Option<&BodyError> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<BodyError>())
    }
}

/// A request body read with a limit on its size and on the time between
/// its frames.
/// Bytes of a refused body read and dropped at most (see
/// [`LimitedBody::drain`]); a longer body is cut off by a close.
pub const DRAIN_BYTES_MAX: u64 = 256 << 10;

pub struct LimitedBody {
    body: Incoming,
    limit: u64,
    read: u64,
    idle: Duration,
    sleep: Pin<Box<tokio::time::Sleep>>,
    pending: Bytes,
    done: bool,
}

impl LimitedBody {
    pub fn new(body: Incoming, limit: u64, idle: Duration) -> Self {
        LimitedBody {
            body,
            limit,
            read: 0,
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
            pending: Bytes::new(),
            done: false,
        }
    }

    /// The next piece of the body; `None` at its end.
    #[allow(clippy::disallowed_methods)] // The idle deadline is a tokio timer's, on tokio's clock.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let deadline = tokio::time::Instant::now() + self.idle;
                    self.sleep.as_mut().reset(deadline);
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers
                    };
                    self.read += data.len() as u64;
                    if self.read > self.limit {
                        self.done = true;
                        return Poll::Ready(Some(Err(BodyError::TooLarge(self.limit))));
                    }
                    if data.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(data)));
                }
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(BodyError::Broken(e.to_string()))));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if self.sleep.as_mut().poll(cx).is_ready() {
                        self.done = true;
                        return Poll::Ready(Some(Err(BodyError::Idle(self.idle))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    /// After a refusal (a body over the limit): reads and drops what is
    /// left of the body, up to [`DRAIN_BYTES_MAX`] more and as long as it
    /// keeps coming, so that the answer is not lost to a reset. A client
    /// still sending when the server closes its socket with bytes unread
    /// gets a TCP reset, which may discard the answer before it reads it.
    pub async fn drain(&mut self) {
        let mut left = DRAIN_BYTES_MAX;
        loop {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut self.body).poll_frame(cx));
            let next = tokio::time::timeout(self.idle, frame).await;
            match next {
                Ok(Some(Ok(frame))) => {
                    let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                    if n > left {
                        return;
                    }
                    left -= n;
                }
                _ => return,
            }
        }
    }

    /// Reads the whole body.
    pub async fn collect(&mut self) -> Result<Bytes, BodyError> {
        let mut all = bytes::BytesMut::new();
        while let Some(chunk) = std::future::poll_fn(|cx| self.poll_chunk(cx)).await {
            let chunk = chunk?;
            if all.is_empty() && self.body.is_end_stream() {
                return Ok(chunk);
            }
            all.extend_from_slice(&chunk);
        }
        Ok(all.freeze())
    }
}

use std::future::Future as _;

impl tokio::io::AsyncRead for LimitedBody {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.pending.is_empty() {
            match me.poll_chunk(cx) {
                Poll::Ready(Some(Ok(b))) => me.pending = b,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into_io())),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = me.pending.len().min(buf.remaining());
        buf.put_slice(&me.pending[..n]);
        me.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}
