//! rotary's etcd v3 client: the cluster's view of journals, members and
//! assignments lives in etcd, and this crate is how a broker reads, writes,
//! leases and watches it.
//!
//! **Threads.** Everything here is async on **tokio**: [`Client::connect`]
//! and every call must run inside a tokio runtime (current-thread or
//! multi-thread), whose tasks carry the gRPC connection and the lease
//! keep-alive task ([`Client::keep_lease_alive`]). In the broker that is
//! the control thread's runtime; shard threads (compio) never call etcd, they
//! receive topology snapshots from the control thread. [`Client`] is
//! `Send + Sync` and cheap to clone.
//!
//! **Bindings.** `proto/` holds the parts of etcd's `rpc.proto` and
//! `kv.proto` that rotary uses, with etcd's package names and field
//! numbers; `build.rs` compiles them with `protox` (pure Rust), so no system
//! `protoc` is needed. The raw generated types are in [`pb`]. They work with
//! etcd 3.4 (Debian's `etcd-server`) and later.
//!
//! **Invariants.** A range over several pages reads every page at the first
//! page's revision. A [`Watcher`] delivers each event exactly once and in
//! revision order across broken streams, or ends with a typed error
//! ([`Error::Compacted`], [`Error::WatchCanceled`]). A [`LeaseKeeper`]'s
//! `valid_until` is never later than etcd's own expiry of the lease.
//! Writes are never retried by the client: a write whose answer was lost
//! may have happened. [`Error::is_retryable`] says whether trying again
//! can help.
//!
//! **Tests.** With the `testing` feature, [`testing::Etcd`] runs a real
//! etcd on free loopback ports.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod pb {
    //! The generated etcd v3 messages and gRPC clients.
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    pub mod mvccpb {
        //! etcd's `mvccpb` package: keys and events.
        include!(concat!(env!("OUT_DIR"), "/mvccpb.rs"));
    }
    pub mod etcdserverpb {
        //! etcd's `etcdserverpb` package: the KV, Watch and Lease services.
        include!(concat!(env!("OUT_DIR"), "/etcdserverpb.rs"));
    }
}

mod client;
mod error;
pub mod keyspace;
mod lease;
mod txn;
mod watch;

#[cfg(feature = "testing")]
pub mod testing;

pub use client::{
    prefix_range, Client, ClientOptions, DeleteResponse, GetResponse, PutResponse, RangeResponse,
};
pub use error::Error;
pub use lease::{Lease, LeaseId, LeaseKeeper, LeaseState};
pub use pb::mvccpb::KeyValue;
pub use txn::{Compare, CompareOp, Op, OpResponse, Txn, TxnResponse};
pub use watch::{Event, EventKind, WatchBatch, WatchOptions, Watcher};
