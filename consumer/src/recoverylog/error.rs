//! The recovery log's errors, and whether each may be retried.

use std::path::PathBuf;

use super::hints::HintsError;
use super::ops::{Author, DecodeError, Fnode, LogPath, PathError, Seqno};

/// The cause a caller's sink or source gives for a failure.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Why an append to the log failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The log's author register names another recorder: this one has been
    /// handed off and must stop.
    #[error("the log is fenced: its author register names another recorder")]
    Fenced,
    /// The append may or may not have committed; appending the same bytes
    /// again is safe (players skip a record they already applied).
    #[error("append failed and may be retried")]
    Unavailable(#[source] Cause),
    /// The append failed and will fail again.
    #[error("append failed")]
    Failed(#[source] Cause),
}

impl SinkError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, SinkError::Unavailable(_))
    }
}

/// Why a read of the log failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Reading again later may succeed.
    #[error("read failed and may be retried")]
    Unavailable(#[source] Cause),
    /// The read failed and will fail again.
    #[error("read failed")]
    Failed(#[source] Cause),
}

impl SourceError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, SourceError::Unavailable(_))
    }
}

/// A record that extends the chain but cannot be applied to the files the
/// chain describes: a bug in the recorder that wrote it, or hints that do
/// not match the log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    #[error("path {0} is already linked")]
    PathExists(LogPath),
    #[error("path {0} is not linked")]
    NoSuchPath(LogPath),
    #[error("fnode {0} is not live")]
    UnknownFnode(Fnode),
    #[error("fnode {fnode} has no link {path}")]
    NoSuchLink { fnode: Fnode, path: LogPath },
    #[error("hints name fnode {0}, but the record at its seqno does not create it")]
    HintedFnodeNotCreated(Fnode),
    #[error("hints name fnode {0}, but playback passed its seqno")]
    HintedFnodeMissing(Fnode),
    #[error("a hand-off inside a hinted segment")]
    HandoffInHintedSegment,
}

/// Everything that can go wrong recording or playing a recovery log.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A frame whose checksums hold but whose record does not decode.
    #[error("malformed record at log offset {offset}")]
    Malformed {
        offset: u64,
        #[source]
        source: DecodeError,
    },
    #[error("record {seqno} cannot be applied")]
    Inconsistent {
        seqno: Seqno,
        #[source]
        kind: Inconsistency,
    },
    #[error("invalid path {path:?}")]
    Path {
        path: String,
        #[source]
        reason: PathError,
    },
    #[error("invalid hints")]
    Hints(#[from] HintsError),
    /// The player read past where the hinted records should have been.
    #[error("log offset {offset} is past the hints' cursor, yet hinted records were not read")]
    HintedRecordsMissing { offset: u64 },
    /// Hints or a recorder were asked of a player still reading hinted
    /// records.
    #[error("playback has not yet read every hinted record")]
    HintsPending,
    #[error("open transaction holds {bytes} bytes, more than the player's limit of {bytes_max}")]
    TransactionTooLarge { bytes: u64, bytes_max: u64 },
    #[error("playback directory {0} exists and is not empty")]
    RootNotEmpty(PathBuf),
    #[error("file operation on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a write of {bytes} bytes at offset {offset} ends past the largest file offset")]
    WriteTooFar { offset: u64, bytes: u64 },
    #[error("hand-off to a recorder of the log's current author {0}")]
    SameAuthor(Author),
    #[error("hand-off by author {author} lost the race to other writers {attempts} times")]
    HandoffLost { author: Author, attempts: u32 },
    /// An earlier append failed for good (or was fenced); the recorder's
    /// records since then were never written.
    #[error("recorder stopped after a failed append")]
    RecorderStopped,
    #[error("appending to the log")]
    Sink(#[from] SinkError),
    #[error("reading the log")]
    Source(#[from] SourceError),
}

impl Error {
    /// Whether doing the same thing again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Sink(error) => error.is_retryable(),
            Error::Source(error) => error.is_retryable(),
            // Another writer was quicker; playing on and trying again may win.
            Error::HandoffLost { .. } => true,
            _ => false,
        }
    }
}
