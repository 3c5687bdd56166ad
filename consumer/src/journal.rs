//! A recovery log in a rotary journal: the [`LogSink`] a recorder appends
//! through and the [`LogSource`] a player reads, over rotary's client.
//!
//! **Fencing.** The journal's `author` register names the recorder that
//! holds the log. A hand-off append sets it (union replaces a register's
//! values, as in Gazette); every other append is checked against it. A
//! recorder that was handed off — a zombie primary, paused past its lease
//! or cut off, while another process took its shard — has its next append
//! refused `REGISTER_MISMATCH`, which the sink reports as
//! [`SinkError::Fenced`]: nothing it records after the hand-off reaches
//! the log, so nothing it would commit or publish after it can count.
//!
//! Both are synchronous (the store's file layer calls them from its own
//! thread) and block on a tokio runtime's handle: call them from a thread
//! that is not one of that runtime's workers (`spawn_blocking`, or a
//! thread of the caller's).

use crate::recoverylog::{Author, LogSink, LogSource, SinkError, SourceError};
use rotary_net::client::{Client, ClientError, ReadEvent};
use rotary_net::spec::{LabelSelector, LabelSet};
use rotary_net::wire::{AppendRequest, ReadRequest};
use rotary_net::Status;
use tokio::runtime::Handle;

/// The register that names a recovery log's author.
pub const AUTHOR_REGISTER: &str = "author";

/// The register's value for `author`: eight hex digits.
pub fn author_value(author: Author) -> String {
    format!("{:08x}", author.get())
}

/// Appends a recorder's frames to its log journal, fenced by the log's
/// author register.
pub struct JournalSink {
    client: Client,
    journal: String,
    author: Author,
    rt: Handle,
}

impl JournalSink {
    pub fn new(client: Client, journal: &str, author: Author, rt: Handle) -> JournalSink {
        JournalSink {
            client,
            journal: journal.to_owned(),
            author,
            rt,
        }
    }

    fn register(&self) -> LabelSet {
        let pair = [(AUTHOR_REGISTER, author_value(self.author))];
        LabelSet::from_pairs(pair).expect("a hex value is a label value")
    }

    fn send(&self, bytes: &[u8], handoff: bool) -> Result<u64, SinkError> {
        let mut req = AppendRequest {
            journal: self.journal.clone(),
            expect_offset: None,
            check_registers: LabelSelector::default(),
            union_registers: LabelSet::new(),
            subtract_registers: LabelSet::new(),
            route_revision: 0,
        };
        if handoff {
            req.union_registers = self.register();
        } else {
            let text = format!("{AUTHOR_REGISTER}={}", author_value(self.author));
            req.check_registers = LabelSelector::parse(&text).expect("a valid selector");
        }
        let appended = self.rt.block_on(self.client.append(&req, bytes.to_vec()));
        match appended {
            Ok(reply) => Ok(reply.begin),
            Err(e) if e.status() == Some(Status::REGISTER_MISMATCH) => Err(SinkError::Fenced),
            Err(e) if e.is_retryable() => Err(SinkError::Unavailable(Box::new(e))),
            Err(e) => Err(SinkError::Failed(Box::new(e))),
        }
    }
}

impl LogSink for JournalSink {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        self.send(bytes, false)
    }

    fn append_handoff(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        self.send(bytes, true)
    }
}

/// Reads a log journal for a player: each call a non-blocking read of the
/// range asked for, so a player that tails simply asks again.
pub struct JournalSource {
    client: Client,
    journal: String,
    rt: Handle,
}

/// A log whose bytes at an offset are gone (its fragments were pruned or
/// lost): playing on past the hole would rebuild wrong files.
#[derive(Debug, thiserror::Error)]
#[error("recovery log {journal}: bytes {asked}..{found} are missing (pruned or lost)")]
pub struct LogHole {
    pub journal: String,
    pub asked: u64,
    pub found: u64,
}

impl JournalSource {
    pub fn new(client: Client, journal: &str, rt: Handle) -> JournalSource {
        JournalSource {
            client,
            journal: journal.to_owned(),
            rt,
        }
    }

    async fn read_range(&self, offset: u64, buf: &mut [u8]) -> Result<usize, SourceError> {
        let req = ReadRequest {
            journal: self.journal.clone(),
            offset: Some(offset),
            end_offset: Some(offset + buf.len() as u64),
            route_revision: 0,
        };
        let mut stream = self
            .client
            .read(&req, false, false)
            .await
            .map_err(source_error)?;
        let mut n = 0;
        while let Some(event) = stream.next().await {
            match event.map_err(source_error)? {
                ReadEvent::Data {
                    offset: at,
                    content,
                } => {
                    if at != offset + n as u64 {
                        let hole = LogHole {
                            journal: self.journal.clone(),
                            asked: offset + n as u64,
                            found: at,
                        };
                        return Err(SourceError::Failed(Box::new(hole)));
                    }
                    buf[n..n + content.len()].copy_from_slice(&content);
                    n += content.len();
                }
                ReadEvent::Done(done) => return done_status(done.status, done.check(), n),
                ReadEvent::Fragment { .. } => unreachable!("the broker proxies history"),
            }
        }
        Err(SourceError::Unavailable(
            "the read ended without READ_DONE".into(),
        ))
    }
}

/// What a READ_DONE means for a player: OK (the range read) and
/// OFFSET_NOT_YET_AVAILABLE (the head, for now) give what was read.
fn done_status(
    status: Status,
    check: Result<(), ClientError>,
    n: usize,
) -> Result<usize, SourceError> {
    match status {
        Status::OK | Status::OFFSET_NOT_YET_AVAILABLE => Ok(n),
        _ => Err(source_error(check.expect_err("a status other than OK"))),
    }
}

fn source_error(e: ClientError) -> SourceError {
    if e.is_retryable() {
        SourceError::Unavailable(Box::new(e))
    } else {
        SourceError::Failed(Box::new(e))
    }
}

impl LogSource for JournalSource {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<usize, SourceError> {
        self.rt.block_on(self.read_range(offset, buf))
    }
}
