//! Recovery logs: every file operation of a shard's embedded store,
//! recorded into a journal, so that playing the journal back rebuilds the
//! store's files byte for byte on another machine.
//!
//! The pieces, from the bottom up:
//!
//! - [`ops`]: the record format. A log is a sequence of framed records,
//!   each one file operation (or a transaction barrier, or a hand-off),
//!   chained by seqno and checksum.
//! - [`hints`]: what a player needs to skip the records of deleted files:
//!   the live files' log segments and the chain's position after a barrier.
//! - [`fsm`]: the state machine that recorders and players both run over
//!   records. It decides which records extend the chain (and ignores the
//!   rest: zombie writes, duplicates), tracks live files and their segments,
//!   and holds the open transaction apart from the committed state.
//! - [`recorder`]: turns a store's file operations into records appended to
//!   a [`LogSink`].
//! - [`player`]: reads a [`LogSource`], runs the FSM and applies committed
//!   transactions to a directory; it tails, and hands the log off to a new
//!   recorder.
//! - [`memlog`]: an in-memory log that is both a sink and a source, for
//!   tests and simulations.
//!
//! Everything runs on the caller's thread and blocks only in the caller's
//! sink and source. Invariants: a record extends the chain only if its
//! seqno is the previous one's plus one, its checksum is the chain's
//! checksum so far and its author is the log's current author (or it is a
//! hand-off); a player applies nothing past the last barrier it has read.

mod error;
pub mod fsm;
pub mod hints;
pub mod memlog;
pub mod ops;
pub mod player;
pub mod recorder;
mod tree;

pub use error::{Cause, Error, Inconsistency, SinkError, SourceError};
pub use fsm::{Counts, Effect, Fsm, Ignored, Outcome, Span, Step, Txn};
pub use hints::{Cursor, FnodeHints, Hints, HintsError, Segment};
pub use memlog::MemLog;
pub use ops::{Author, DecodeError, Fnode, LogPath, Op, PathError, Record, Seqno};
pub use player::{LogSource, PlayCounts, Player, PlayerConfig, Progress};
pub use recorder::{LogSink, Recorder};
