//! The crate's one error type.

use std::time::Duration;

/// Everything that can go wrong talking to etcd.
///
/// [`Error::is_retryable`] says whether the same call may succeed later
/// (etcd or the network was unavailable, a leader election, a timeout) or
/// whether the caller must change something first (a compacted revision, a
/// lost lease, a bad argument).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `Client::connect` was given no endpoints.
    #[error("no etcd endpoint was given")]
    NoEndpoints,

    /// An endpoint is not a URL etcd could serve on.
    #[error("invalid etcd endpoint {endpoint:?}: expected http://HOST:PORT")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
    },

    /// No endpoint accepted a connection.
    #[error("cannot connect to any etcd endpoint ({endpoints}): {source}")]
    Connect {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// The last endpoint's error.
        #[source]
        source: tonic::transport::Error,
    },

    /// etcd (or the transport under it) answered a call with a gRPC status.
    #[error("etcd {op} failed: {code:?}: {message}", code = status.code(), message = status.message())]
    Status {
        /// The call, e.g. `"range"`, `"txn"`.
        op: &'static str,
        /// The status as received.
        status: tonic::Status,
    },

    /// A call got no answer within the client's request timeout.
    #[error("etcd {op} got no answer within {timeout:?}")]
    Timeout {
        /// The call.
        op: &'static str,
        /// The timeout that elapsed.
        timeout: Duration,
    },

    /// A stream (watch, lease keep-alive) ended without an error status:
    /// etcd closed it or the connection went away.
    #[error("etcd {op} stream ended")]
    StreamClosed {
        /// The stream's call.
        op: &'static str,
    },

    /// The lease does not exist (it expired or was revoked).
    #[error("etcd lease {lease_id:#x} is gone (expired or revoked)")]
    LeaseNotFound {
        /// The lease.
        lease_id: i64,
    },

    /// A lease could not be renewed in time: it may have expired, so nothing
    /// written under it may be relied on any more.
    #[error("etcd lease {lease_id:#x} was not renewed before it could expire")]
    LeaseExpired {
        /// The lease.
        lease_id: i64,
    },

    /// A watch asked for history that etcd has compacted away. The watcher
    /// cannot resume: read the current state again and watch from there.
    #[error(
        "etcd cannot watch from revision {start_revision}: history is compacted through revision {compact_revision}"
    )]
    Compacted {
        /// The first revision the watch needed.
        start_revision: i64,
        /// etcd's compaction revision: the oldest revision it still has.
        compact_revision: i64,
    },

    /// etcd canceled a watch for a reason other than compaction.
    #[error("etcd canceled the watch of {key:?}: {reason:?}")]
    WatchCanceled {
        /// The watched key or prefix, lossily as UTF-8.
        key: String,
        /// etcd's `cancel_reason` (empty when etcd gave none).
        reason: String,
    },

    /// An argument the client can check before sending.
    #[error("invalid etcd request: {what}")]
    InvalidArgument {
        /// What is wrong.
        what: &'static str,
    },

    /// etcd answered with something this client cannot interpret.
    #[error("etcd answered {op} with a malformed response: {what}")]
    Malformed {
        /// The call.
        op: &'static str,
        /// What was missing or wrong.
        what: &'static str,
    },
}

impl Error {
    /// Whether the same call may succeed if tried again later (possibly
    /// against another endpoint), without changing anything.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Connect { .. } | Error::Timeout { .. } | Error::StreamClosed { .. } => true,
            Error::Status { status, .. } => is_retryable_code(status.code()),
            Error::NoEndpoints
            | Error::InvalidEndpoint { .. }
            | Error::LeaseNotFound { .. }
            | Error::LeaseExpired { .. }
            | Error::Compacted { .. }
            | Error::WatchCanceled { .. }
            | Error::InvalidArgument { .. }
            | Error::Malformed { .. } => false,
        }
    }

    /// Whether the error says the connection or the endpoint is unusable,
    /// so the client should move on to another endpoint.
    pub(crate) fn is_endpoint_failure(&self) -> bool {
        match self {
            Error::Connect { .. } | Error::Timeout { .. } | Error::StreamClosed { .. } => true,
            Error::Status { status, .. } => matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
            ),
            _ => false,
        }
    }

    pub(crate) fn status(op: &'static str, status: tonic::Status) -> Error {
        Error::Status { op, status }
    }
}

/// gRPC codes etcd uses for conditions that pass: no leader, leader changed,
/// request timed out, too many requests, and transport failures.
fn is_retryable_code(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::ResourceExhausted
            | tonic::Code::Aborted
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_follows_the_condition() {
        let unavailable = Error::status(
            "put",
            tonic::Status::unavailable("etcdserver: leader changed"),
        );
        assert!(unavailable.is_retryable());
        let invalid = Error::status(
            "put",
            tonic::Status::invalid_argument("etcdserver: key is not provided"),
        );
        assert!(!invalid.is_retryable());
        assert!(Error::Timeout {
            op: "range",
            timeout: Duration::from_secs(1)
        }
        .is_retryable());
        assert!(!Error::Compacted {
            start_revision: 3,
            compact_revision: 9
        }
        .is_retryable());
        assert!(!Error::LeaseNotFound { lease_id: 7 }.is_retryable());
        assert!(!Error::LeaseExpired { lease_id: 7 }.is_retryable());
    }

    #[test]
    fn messages_name_the_call_and_the_cause() {
        let e = Error::status("txn", tonic::Status::unavailable("etcdserver: no leader"));
        assert_eq!(
            e.to_string(),
            "etcd txn failed: Unavailable: etcdserver: no leader"
        );
        let e = Error::Compacted {
            start_revision: 3,
            compact_revision: 9,
        };
        assert_eq!(
            e.to_string(),
            "etcd cannot watch from revision 3: history is compacted through revision 9"
        );
    }
}
