//! Status codes carried in every reply frame.
//!
//! The first block follows Gazette's `Status` enum name for name; the block
//! from 64 up is what rotary adds. Numbers are part of the wire format and
//! never change meaning.

use serde::{Deserialize, Serialize};

macro_rules! statuses {
    ($($(#[doc = $doc:literal])* $name:ident = $code:literal, retry = $retry:literal;)*) => {
        /// Outcome of a request, as carried in a reply frame's `status` field.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[allow(non_camel_case_types)]
        #[repr(u16)]
        pub enum Status {
            $($(#[doc = $doc])* $name = $code,)*
        }

        impl Status {
            /// Decodes a wire status; unknown codes are `None`.
            pub fn from_code(code: u16) -> Option<Status> {
                match code {
                    $($code => Some(Status::$name),)*
                    _ => None,
                }
            }

            /// The status's name, exactly as documented in `docs/PROTOCOL.md`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Status::$name => stringify!($name),)*
                }
            }

            /// Whether the same request may succeed if sent again later.
            pub fn is_retryable(self) -> bool {
                match self {
                    $(Status::$name => $retry,)*
                }
            }

            /// Every status, in code order.
            pub const ALL: &'static [Status] = &[$(Status::$name,)*];
        }
    };
}

statuses! {
    /// The request succeeded.
    OK = 0, retry = false;
    /// No journal of that name exists.
    JOURNAL_NOT_FOUND = 1, retry = false;
    /// The journal has no primary broker right now.
    NO_JOURNAL_PRIMARY_BROKER = 2, retry = true;
    /// This broker is not the journal's primary and proxying was refused.
    NOT_JOURNAL_PRIMARY_BROKER = 3, retry = false;
    /// This broker is not in the journal's route and proxying was refused.
    NOT_JOURNAL_BROKER = 4, retry = false;
    /// The journal's route has fewer brokers than its replication factor.
    INSUFFICIENT_JOURNAL_BROKERS = 5, retry = true;
    /// A non-blocking read asked for an offset at or beyond the write head.
    OFFSET_NOT_YET_AVAILABLE = 6, retry = true;
    /// A peer knows a different route for the journal.
    WRONG_ROUTE = 7, retry = true;
    /// A replica's view of the spool disagrees with a proposal.
    PROPOSAL_MISMATCH = 8, retry = true;
    /// A cluster metadata transaction failed.
    ETCD_TRANSACTION_FAILED = 9, retry = true;
    /// The journal's flags forbid the operation (read-only or write-only).
    NOT_ALLOWED = 10, retry = false;
    /// The append's expected offset is not the write head.
    WRONG_APPEND_OFFSET = 11, retry = false;
    /// The fragment index holds data beyond the write head; reset the head first.
    INDEX_HAS_GREATER_OFFSET = 12, retry = false;
    /// The journal's registers do not match the append's selector.
    REGISTER_MISMATCH = 13, retry = false;
    /// The journal is suspended.
    SUSPENDED = 14, retry = true;
    /// A fragment store the journal needs cannot be reached.
    FRAGMENT_STORE_UNHEALTHY = 15, retry = true;
    /// The request is malformed: bad journal name, bad spec, unknown flag, etc.
    BAD_REQUEST = 64, retry = false;
    /// A frame exceeded the receiver's size limit.
    FRAME_TOO_LARGE = 65, retry = false;
    /// The data disk is full or below its reserved headroom; retry later.
    STORAGE_FULL = 66, retry = true;
    /// The local spool budget is spent while uploads catch up; retry later.
    SPOOL_BUDGET_EXHAUSTED = 67, retry = true;
    /// A local I/O error failed the request; nothing of it was committed.
    /// The error may pass (a disk that failed for good is `DISK_FAILED`).
    IO_ERROR = 68, retry = true;
    /// The broker is shutting down; retry against another broker or later.
    SHUTTING_DOWN = 69, retry = true;
    /// A streamed append went idle for too long and was rolled back.
    APPEND_TIMEOUT = 70, retry = true;
    /// The request was cancelled by the client.
    CANCELLED = 71, retry = false;
    /// The journal already exists (on create-only applies).
    JOURNAL_EXISTS = 72, retry = false;
    /// A replica in the journal's route did not acknowledge the append (it
    /// is unreachable or failed). The append may have committed, as after a
    /// broken connection; it is never partly visible.
    REPLICATION_FAILED = 73, retry = true;
    /// The connection holds as many open requests of the kind as it may
    /// (streamed appends, reads, replicated appends); finish or cancel some
    /// first, or use another connection.
    TOO_MANY_REQUESTS = 74, retry = true;
    /// The broker's disk failed for good (EIO, a read-only or corrupt file
    /// system) under the journal: nothing of the request was committed,
    /// and the broker takes no more appends to it until an operator
    /// replaces the disk and restarts it. What committed before can still
    /// be read.
    DISK_FAILED = 75, retry = false;
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &s in Status::ALL {
            assert!(seen.insert(s as u16), "duplicate code {}", s as u16);
            assert_eq!(Status::from_code(s as u16), Some(s));
        }
        assert_eq!(Status::from_code(999), None);
        assert_eq!(Status::WRONG_APPEND_OFFSET.name(), "WRONG_APPEND_OFFSET");
        assert!(Status::STORAGE_FULL.is_retryable());
        assert!(!Status::BAD_REQUEST.is_retryable());
        assert!(Status::IO_ERROR.is_retryable());
        assert!(!Status::DISK_FAILED.is_retryable());
    }
}
