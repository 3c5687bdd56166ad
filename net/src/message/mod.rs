//! Messages on journals, in Gazette's formats: UUIDs, framings, a
//! transactional publisher and read-committed readers.
//!
//! The broker stays a byte broker; messages live entirely in the client.
//! Each message carries a [`Uuid`] naming its producer, the producer's
//! [`Clock`] when it was published and its transaction [`Flags`]. A
//! [`Publisher`] writes messages outside transactions (committed at once)
//! or inside one spanning any journals, ended by [`Publisher::commit`],
//! which appends an acknowledgement to each journal the transaction
//! touched. It retries appends whose outcome is unknown itself, so a
//! journal may hold a message twice; a [`Reader`] in read-committed mode
//! runs a [`Sequencer`] per stream that delivers each committed message
//! once, holds transaction messages until their acknowledgement, and drops
//! rolled-back ones and duplicates. A reader's [`Checkpoint`] restores it
//! exactly where it stopped.
//!
//! Everything here runs on the caller's tokio runtime; the publisher spawns
//! one task per journal it writes, which appends that journal's messages
//! one append at a time, in clock order. `docs/MESSAGES.md` describes the
//! formats byte for byte.

pub mod framing;
mod intern;
pub mod publisher;
pub mod reader;
pub mod sequencer;
pub mod uuid;

pub use framing::{Decoder, Framing};
pub use publisher::{Publisher, PublisherOptions, PublisherStats};
pub use reader::{ReadMode, Reader, ReaderOptions};
pub use sequencer::{Checkpoint, ProducerState, QueueOutcome, Sequencer};
pub use uuid::{Clock, Flags, ProducerId, Uuid};

use crate::client::ClientError;
use bytes::Bytes;
use std::sync::Arc;

/// One message read from a journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub journal: Arc<str>,
    /// Where its frame begins and ends in the journal.
    pub begin: u64,
    pub end: u64,
    pub uuid: Uuid,
    /// JSON lines: the document (the line without its newline). Fixed
    /// framing: the message's content.
    pub message: Bytes,
}

impl Envelope {
    pub fn producer(&self) -> ProducerId {
        self.uuid.producer()
    }

    pub fn clock(&self) -> Clock {
        self.uuid.clock()
    }

    pub fn flags(&self) -> Flags {
        self.uuid.flags()
    }

    /// An acknowledgement: it commits (or rolls back) a transaction and
    /// carries no application content.
    pub fn is_ack(&self) -> bool {
        self.flags() == Flags::ACK_TXN
    }
}

/// What went wrong with messages.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    /// A request to the broker failed (and was not retried, or is not
    /// retryable).
    #[error(transparent)]
    Client(#[from] ClientError),
    /// An append failed after the publisher retried it for as long as it
    /// was allowed, or with a status retrying cannot help. Its messages may
    /// or may not be in the journal.
    #[error("{journal}: append failed: {why}")]
    Append {
        journal: String,
        why: String,
        /// The broker's status, if it refused the last try.
        status: Option<crate::status::Status>,
        retryable: bool,
    },
    /// An earlier append to the journal failed: the transaction must be
    /// rolled back before the journal takes more messages.
    #[error("{journal}: an earlier append failed ({why}); roll the transaction back")]
    Poisoned { journal: String, why: String },
    /// Appends to more than one journal failed: each error names its
    /// journal.
    #[error("appends to {} journals failed: {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Journals(Vec<MessageError>),
    #[error("journal {journal} not found")]
    JournalNotFound { journal: String },
    /// The journal's `content-type` label names no framing this client has.
    #[error("journal {journal}: {} names no framing: want content-type application/x-ndjson or application/x-protobuf-fixed", .content_type.as_deref().map_or("no content-type label".to_string(), |c| format!("content-type {c:?}")))]
    NoFraming {
        journal: String,
        content_type: Option<String>,
    },
    #[error("UUID pointer {pointer:?} is not a JSON pointer such as /_meta/uuid")]
    BadPointer { pointer: String },
    /// The application's message cannot be framed.
    #[error("bad message: {why}")]
    BadPayload { why: String },
    #[error("{text:?} is not a UUID")]
    BadUuid { text: String },
    #[error("{text:?} is not a producer id (12 hex digits)")]
    BadProducer { text: String },
    /// A journal took committed and transaction messages of one producer
    /// at once.
    #[error("{journal}: publish_committed during a transaction that touched the journal; commit or roll back first")]
    MixedTransaction { journal: String },
    #[error("checkpoint: {why}")]
    BadCheckpoint { why: String },
    /// A replay read something other than the range it asked for.
    #[error("replay of {journal} [{begin}, {end}): {why}")]
    Replay {
        journal: String,
        begin: u64,
        end: u64,
        why: String,
    },
}

impl MessageError {
    /// Whether the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            MessageError::Client(e) => e.is_retryable(),
            MessageError::Append { retryable, .. } => *retryable,
            MessageError::Journals(errors) => errors.iter().all(MessageError::is_retryable),
            _ => false,
        }
    }

    /// The journals whose appends this error is about (none for errors
    /// of no journal's appends).
    pub fn failed_journals(&self) -> Vec<&str> {
        match self {
            MessageError::Append { journal, .. } | MessageError::Poisoned { journal, .. } => {
                vec![journal.as_str()]
            }
            MessageError::Journals(errors) => errors
                .iter()
                .flat_map(MessageError::failed_journals)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// One error for the failures of a flush: none, the one, or all of
    /// them.
    fn of_all(mut errors: Vec<MessageError>) -> Result<(), MessageError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.pop().expect("one")),
            _ => Err(MessageError::Journals(errors)),
        }
    }
}
