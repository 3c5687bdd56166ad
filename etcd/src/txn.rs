//! Transactions: comparisons, then/else ops, and what they returned.

use crate::client::{header_revision, prefix_range};
use crate::error::Error;
use crate::pb::etcdserverpb as rpc;
use crate::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use crate::pb::mvccpb::KeyValue;
use crate::LeaseId;

/// How a comparison relates the key's field (left) to the given value (right).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareOp {
    /// `field == value`
    Equal,
    /// `field != value`
    NotEqual,
    /// `field > value`
    Greater,
    /// `field < value`
    Less,
}

impl CompareOp {
    fn to_pb(self) -> CompareResult {
        match self {
            CompareOp::Equal => CompareResult::Equal,
            CompareOp::NotEqual => CompareResult::NotEqual,
            CompareOp::Greater => CompareResult::Greater,
            CompareOp::Less => CompareResult::Less,
        }
    }
}

/// One guard of a transaction. A key that does not exist has create and
/// mod revision 0, version 0 and no value.
#[derive(Clone, Debug, PartialEq)]
pub struct Compare(rpc::Compare);

impl Compare {
    fn new(key: Vec<u8>, op: CompareOp, target: CompareTarget, value: TargetUnion) -> Compare {
        Compare(rpc::Compare {
            result: op.to_pb() as i32,
            target: target as i32,
            key,
            target_union: Some(value),
            range_end: Vec::new(),
        })
    }

    /// Compares the revision of the key's last modification.
    pub fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Compare {
        Compare::new(
            key.into(),
            op,
            CompareTarget::Mod,
            TargetUnion::ModRevision(revision),
        )
    }

    /// Compares the revision of the key's creation.
    pub fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Compare {
        Compare::new(
            key.into(),
            op,
            CompareTarget::Create,
            TargetUnion::CreateRevision(revision),
        )
    }

    /// Compares the key's version (modifications since creation).
    pub fn version(key: impl Into<Vec<u8>>, op: CompareOp, version: i64) -> Compare {
        Compare::new(
            key.into(),
            op,
            CompareTarget::Version,
            TargetUnion::Version(version),
        )
    }

    /// Compares the key's value, bytewise.
    pub fn value(key: impl Into<Vec<u8>>, op: CompareOp, value: impl Into<Vec<u8>>) -> Compare {
        Compare::new(
            key.into(),
            op,
            CompareTarget::Value,
            TargetUnion::Value(value.into()),
        )
    }

    /// Compares the mod revision of every key with the (non-empty) prefix:
    /// holds when each key's does, or when there is no such key and a key
    /// that does not exist (mod revision 0) would (etcd's range compare).
    /// `mod_revision_of_prefix(p, Less, r + 1)`: no key with the prefix was
    /// created or changed after revision `r`.
    pub fn mod_revision_of_prefix(
        prefix: impl Into<Vec<u8>>,
        op: CompareOp,
        revision: i64,
    ) -> Compare {
        let (key, range_end) = prefix_range(prefix.into());
        let mut c = Compare::mod_revision(key, op, revision);
        c.0.range_end = range_end;
        c
    }

    /// Holds when the key does not exist.
    pub fn absent(key: impl Into<Vec<u8>>) -> Compare {
        Compare::create_revision(key, CompareOp::Equal, 0)
    }

    /// Holds when the key exists and was last modified at `revision`.
    pub fn unchanged_since(key: impl Into<Vec<u8>>, revision: i64) -> Compare {
        Compare::mod_revision(key, CompareOp::Equal, revision)
    }
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq)]
pub struct Op(rpc::RequestOp);

impl Op {
    fn request(request: rpc::request_op::Request) -> Op {
        Op(rpc::RequestOp {
            request: Some(request),
        })
    }

    /// Reads one key (answered as [`OpResponse::Range`]).
    pub fn get(key: impl Into<Vec<u8>>) -> Op {
        Op::request(rpc::request_op::Request::RequestRange(rpc::RangeRequest {
            key: key.into(),
            ..Default::default()
        }))
    }

    /// Reads every key with the prefix, unpaged (answered as [`OpResponse::Range`]).
    pub fn get_prefix(prefix: impl Into<Vec<u8>>) -> Op {
        let (key, range_end) = prefix_range(prefix.into());
        Op::request(rpc::request_op::Request::RequestRange(rpc::RangeRequest {
            key,
            range_end,
            ..Default::default()
        }))
    }

    /// Writes a key, under `lease` if given.
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: Option<LeaseId>) -> Op {
        Op::request(rpc::request_op::Request::RequestPut(rpc::PutRequest {
            key: key.into(),
            value: value.into(),
            lease: lease.map_or(0, |l| l.0),
            ..Default::default()
        }))
    }

    /// Writes a key's value and keeps the lease it has (etcd's
    /// `ignore_lease`): for a key that lives under another client's lease.
    /// The key must exist, or etcd refuses the transaction.
    pub fn put_keep_lease(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Op {
        Op::request(rpc::request_op::Request::RequestPut(rpc::PutRequest {
            key: key.into(),
            value: value.into(),
            ignore_lease: true,
            ..Default::default()
        }))
    }

    /// Deletes one key.
    pub fn delete(key: impl Into<Vec<u8>>) -> Op {
        Op::request(rpc::request_op::Request::RequestDeleteRange(
            rpc::DeleteRangeRequest {
                key: key.into(),
                ..Default::default()
            },
        ))
    }

    /// Deletes every key with the (non-empty) prefix.
    pub fn delete_prefix(prefix: impl Into<Vec<u8>>) -> Op {
        let (key, range_end) = prefix_range(prefix.into());
        Op::request(rpc::request_op::Request::RequestDeleteRange(
            rpc::DeleteRangeRequest {
                key,
                range_end,
                ..Default::default()
            },
        ))
    }
}

/// A transaction: `when` every comparison holds, run `and_then`, else `or_else`.
///
/// ```
/// use rotary_etcd::{Compare, Op, Txn};
/// // Create a key only if it does not exist yet.
/// let txn = Txn::new()
///     .when([Compare::absent("/rotary/items/a")])
///     .and_then([Op::put("/rotary/items/a", "spec", None)])
///     .or_else([Op::get("/rotary/items/a")]);
/// # let _ = txn;
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Txn {
    compare: Vec<rpc::Compare>,
    success: Vec<rpc::RequestOp>,
    failure: Vec<rpc::RequestOp>,
}

impl Txn {
    /// An empty transaction (no guards: its `and_then` branch runs).
    pub fn new() -> Txn {
        Txn::default()
    }

    /// Adds guards; all must hold.
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Txn {
        self.compare.extend(compares.into_iter().map(|c| c.0));
        self
    }

    /// Adds ops to run when the guards hold.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = Op>) -> Txn {
        self.success.extend(ops.into_iter().map(|o| o.0));
        self
    }

    /// Adds ops to run when a guard fails.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = Op>) -> Txn {
        self.failure.extend(ops.into_iter().map(|o| o.0));
        self
    }

    pub(crate) fn into_request(self) -> rpc::TxnRequest {
        rpc::TxnRequest {
            compare: self.compare,
            success: self.success,
            failure: self.failure,
        }
    }
}

/// What a transaction did.
#[derive(Clone, Debug, PartialEq)]
pub struct TxnResponse {
    /// Whether the guards held (so the `and_then` branch ran).
    pub succeeded: bool,
    /// The store's revision after the transaction (its own revision if it
    /// wrote anything, else the revision it read at).
    pub revision: i64,
    /// One response per op of the branch that ran, in order.
    pub responses: Vec<OpResponse>,
}

/// The answer to one [`Op`].
#[derive(Clone, Debug, PartialEq)]
pub enum OpResponse {
    /// To [`Op::get`] / [`Op::get_prefix`].
    Range {
        /// The keys, in key order.
        kvs: Vec<KeyValue>,
    },
    /// To [`Op::put`].
    Put,
    /// To [`Op::delete`] / [`Op::delete_prefix`].
    Delete {
        /// How many keys were deleted.
        deleted: i64,
    },
}

impl TxnResponse {
    pub(crate) fn from_pb(response: rpc::TxnResponse) -> Result<TxnResponse, Error> {
        let revision = header_revision("txn", response.header.as_ref())?;
        let mut responses = Vec::with_capacity(response.responses.len());
        for op in response.responses {
            use rpc::response_op::Response;
            responses.push(match op.response {
                Some(Response::ResponseRange(r)) => OpResponse::Range { kvs: r.kvs },
                Some(Response::ResponsePut(_)) => OpResponse::Put,
                Some(Response::ResponseDeleteRange(r)) => OpResponse::Delete { deleted: r.deleted },
                // This client never sends nested transactions.
                Some(Response::ResponseTxn(_)) | None => {
                    return Err(Error::Malformed {
                        op: "txn",
                        what: "an op response of a kind that was not requested",
                    })
                }
            });
        }
        Ok(TxnResponse {
            succeeded: response.succeeded,
            revision,
            responses,
        })
    }
}
