//! Async client for ordinary tokio applications.
//!
//! [`Client::connect`] takes any shard's endpoint. A client is cheap to clone
//! (clones share connections and routes). Requests naming a journal go to
//! the shard that owns it: the client asks ROUTE once per journal, caches the
//! answer, and keeps one TCP connection per shard endpoint, opened lazily.
//! Requests without a journal (APPLY, LIST, STATS, PING) go to the endpoint
//! the client was connected with.
//!
//! Every connection carries many requests at once: each has its own request
//! id, a reader task hands replies to the waiting request, and a writer task
//! batches queued frames into few syscalls. Concurrent [`Client::append`]
//! calls are therefore pipelined on one connection; the broker still commits
//! appends to one journal one after another, each whole.
//!
//! History that lives only in a fragment store can be read two ways: a
//! plain [`Client::read`] lets the broker stream it (proxied), while
//! [`Client::read_direct`] asks for the fragment's location and fetches the
//! object itself, checking its SHA-1, then rejoins the broker at the
//! fragment's end in the same offset space.
//!
//! Nothing here retries on its own. [`ClientError::is_retryable`] says when
//! sending the same request again may succeed; note that an append whose
//! connection broke may or may not have committed.

mod conn;
mod direct;
mod fetch;
mod silent;

pub use conn::{
    CONNECT_TIMEOUT, READ_FRAMES_BUFFERED_MAX, REPLY_BODY_LEN_MAX, SILENCE_DEFAULT,
    WRITE_QUEUE_BYTES_MAX,
};
pub use direct::{
    DirectRead, DirectReadStats, DIRECT_AHEAD_BYTES_MAX, DIRECT_DATA_LEN_MAX,
    DIRECT_FETCHES_AHEAD_MAX,
};
pub use fetch::{
    FragmentError, FETCH_CONNECT_TIMEOUT, FETCH_READ_TIMEOUT, FRAGMENT_DIRECT_LEN_MAX,
};
pub use silent::SILENT_ROUTE_POLL;

use crate::spec::{Codec, JournalSpec, SpecError, JOURNAL_NAME_LEN_MAX};
use crate::status::Status;
use crate::wire::{self, flag, AppendReply, AppendRequest, Op, ReadRequest, WireError};
use bytes::{Bytes, BytesMut};
use conn::{Conn, Reply, Waiter};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, oneshot};

/// Content up to this length goes in the APPEND frame itself; longer content
/// is sent as APPEND plus APPEND_CHUNK frames of this length.
pub const APPEND_CHUNK_LEN: usize = 1 << 20;
/// [`Client::append_stream`] sends what it has read once the reader has been
/// quiet this long, rather than waiting to fill a whole chunk.
pub const APPEND_STREAM_COALESCE: Duration = Duration::from_millis(5);
/// Journals whose route the client remembers; the cache is cleared when full.
pub const ROUTE_CACHE_JOURNALS_MAX: usize = 65_536;

const _: () = assert!(APPEND_CHUNK_LEN <= wire::PAYLOAD_LEN_MAX);

/// Why a reply could not be understood.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProtocolError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{got:?} does not answer {request:?}")]
    UnexpectedOp { request: Op, got: Op },
    #[error("reply JSON: {0}")]
    Json(Arc<serde_json::Error>),
    #[error("read stream ended without READ_DONE")]
    Truncated,
    #[error("READ_FRAGMENT names unknown codec {0}")]
    UnknownCodec(u8),
    #[error("READ_FRAGMENT location is not UTF-8")]
    LocationNotUtf8,
    #[error("READ_FRAGMENT range [{begin}, {end}) does not hold offset {offset}")]
    FragmentRange { begin: u64, end: u64, offset: u64 },
}

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The broker answered with a status other than OK.
    #[error("{status}: {message}")]
    Status {
        status: Status,
        /// The broker's explanation.
        message: String,
        /// For appends: the decoded reply (write head, registers), when the
        /// broker sent one.
        append_reply: Option<Box<AppendReply>>,
    },
    /// Connecting, writing or reading failed, or the broker closed the
    /// connection while the request was in flight.
    #[error("{endpoint}: {source}")]
    Io {
        endpoint: String,
        #[source]
        source: Arc<io::Error>,
    },
    /// The broker sent something this client does not understand.
    #[error("{endpoint}: protocol error: {source}")]
    Protocol {
        endpoint: String,
        #[source]
        source: ProtocolError,
    },
    /// The request cannot be encoded (name too long, bad selector text, …).
    #[error("invalid request: {0}")]
    Invalid(#[from] SpecError),
    /// The content reader of [`Client::append_stream`] failed; the append
    /// was rolled back.
    #[error("reading append content: {0}")]
    Content(#[source] io::Error),
    /// A direct read fetched a fragment whose bytes do not match its name
    /// (none of them were yielded).
    #[error(transparent)]
    Fragment(#[from] FragmentError),
    /// A requested offset exceeds [`wire::OFFSET_MAX`]: the wire carries
    /// offsets as `i64`, and it would wrap to a negative value (`-1` is "no
    /// expected offset" on APPEND, "the write head" on READ). Nothing was
    /// sent.
    #[error("invalid request: {0}")]
    Offset(#[source] WireError),
}

impl ClientError {
    /// The broker's status, if the broker answered.
    pub fn status(&self) -> Option<Status> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The decoded APPEND_REPLY of a refused append (e.g. the write head on
    /// WRONG_APPEND_OFFSET, the registers on REGISTER_MISMATCH).
    pub fn append_reply(&self) -> Option<&AppendReply> {
        match self {
            ClientError::Status { append_reply, .. } => append_reply.as_deref(),
            _ => None,
        }
    }

    /// Whether the same request may succeed if sent again later: the
    /// status's own rule ([`Status::is_retryable`]), except that a refusal
    /// saying the journal's route moved (`NOT_JOURNAL_PRIMARY_BROKER`,
    /// `NOT_JOURNAL_BROKER`) is retryable here, since this client asks ROUTE
    /// again before it sends the journal's next request; connection failures
    /// are retryable (an append's outcome is then unknown: it may have
    /// committed); protocol errors and invalid requests are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Status {
                status: Status::NOT_JOURNAL_PRIMARY_BROKER | Status::NOT_JOURNAL_BROKER,
                ..
            } => true,
            ClientError::Status { status, .. } => status.is_retryable(),
            ClientError::Io { .. } => true,
            ClientError::Protocol { .. }
            | ClientError::Invalid(_)
            | ClientError::Offset(_)
            | ClientError::Content(_)
            | ClientError::Fragment(_) => false,
        }
    }
}

/// Where a journal lives, as ROUTE answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteInfo {
    pub journal: String,
    /// The shard of the answering broker that owns the journal.
    pub shard: u32,
    pub shards: u32,
    /// Where to send the journal's appends: the primary's shard endpoint.
    pub endpoint: String,
    /// The answering broker's id (`local` for a broker without a cluster).
    #[serde(default)]
    pub broker: String,
    /// The answering broker's shard endpoint for the journal.
    #[serde(default)]
    pub local_endpoint: String,
    /// The brokers holding the journal, primary first.
    #[serde(default)]
    pub members: Vec<RouteMember>,
    /// In a cluster on etcd, the etcd revision the route was read at; 0
    /// outside etcd.
    #[serde(default)]
    pub revision: u64,
}

/// One broker of a journal's route.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteMember {
    pub id: String,
    #[serde(default)]
    pub zone: String,
    /// The member's shard endpoint for the journal.
    pub endpoint: String,
}

/// The route part of a LIST entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalRoute {
    pub shard: u32,
    pub endpoint: String,
    /// Id of the primary broker.
    #[serde(default)]
    pub primary: String,
    /// Ids of the brokers holding the journal, primary first.
    #[serde(default)]
    pub members: Vec<String>,
    /// In a cluster on etcd, the etcd revision the route was read at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_revision: Option<i64>,
}

/// One broker of the cluster, as MEMBERS answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub id: String,
    #[serde(default)]
    pub zone: String,
    /// Shard 0's address.
    pub endpoint: String,
    /// Journals it may hold (0: no limit is known, outside etcd).
    #[serde(default)]
    pub journal_limit: u32,
    /// Journals it holds, as primary or replica, and of those as primary.
    pub journals: usize,
    pub primaries: usize,
    /// It is leaving: its journals move to other brokers.
    #[serde(default)]
    pub exiting: bool,
}

/// Options of [`Client::append_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendOptions {
    /// Refuse with NOT_JOURNAL_PRIMARY_BROKER instead of being proxied to
    /// the primary when the broker reached is not the journal's primary.
    pub do_not_proxy: bool,
}

/// One LIST entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalInfo {
    pub spec: JournalSpec,
    /// The revision of the spec's last change (0 from brokers before
    /// revisions).
    #[serde(default)]
    pub revision: u64,
    pub route: JournalRoute,
}

/// A page of a journal's fragments ([`Client::fragments_page`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FragmentPage {
    pub fragments: Vec<FragmentInfo>,
    /// Where the next page begins (its `from`), if fragments remain.
    pub next: Option<u64>,
}

/// One fragment of a journal, as FRAGMENTS and SEAL answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentInfo {
    pub begin: u64,
    pub end: u64,
    /// SHA-1 of the fragment's bytes, 40 hex digits.
    pub sha1: String,
    pub codec: Codec,
    /// Bytes the fragment occupies where it is stored.
    #[serde(default)]
    pub size: u64,
    /// `local` or a store URL.
    #[serde(default)]
    pub store: String,
    #[serde(default)]
    pub path: String,
    /// Unix seconds.
    #[serde(default)]
    pub mod_time: u64,
    /// The live spool, not yet sealed.
    #[serde(default)]
    pub open: bool,
    /// For a store fragment: its object key, relative to the store URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// For a local sealed fragment of a journal with stores: whether it has
    /// been uploaded to the journal's first store. Absent for a journal
    /// without stores, whose fragments stay local.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded: Option<bool>,
    /// For a local sealed fragment whose file was found not to hold its
    /// bytes (by its upload): what was found. Its span is no longer read
    /// from that file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub damaged: Option<String>,
    /// For a store fragment that overlaps another with other bytes and is
    /// not the journal's committed history (PROTOCOL §7): why, naming the
    /// other. It is never served; `prune` removes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conflicting: Option<String>,
    /// For a store fragment that disagrees with another where the broker
    /// cannot tell which is committed: why, naming both. Reads of its span
    /// are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disputed: Option<String>,
}

/// A journal's write head after RESET_HEAD.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetHead {
    pub journal: String,
    pub write_head: u64,
}

/// One store fragment PRUNE removed (or, with `dry_run`, would remove).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrunedFragment {
    pub journal: String,
    pub begin: u64,
    pub end: u64,
    /// SHA-1 of the fragment's bytes, 40 hex digits.
    pub sha1: String,
    /// The store URL.
    pub store: String,
    /// The object key, relative to the store URL.
    pub key: String,
    /// How old the object was, from its modification time.
    pub age_secs: u64,
    /// Set when it was removed for disagreeing with the journal's
    /// committed history rather than for its age: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conflicting: Option<String>,
}

/// Flags of a READ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Wait at the write head for more content.
    pub block: bool,
    /// Answer with READ_DONE (offset, write head) only.
    pub metadata_only: bool,
    /// Do not let the broker proxy store-held history: it answers with
    /// [`ReadEvent::Fragment`] (where to fetch it) instead.
    pub do_not_proxy: bool,
}

/// One item of a [`ReadStream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadEvent {
    /// Journal bytes starting at `offset`.
    Data { offset: u64, content: Bytes },
    /// Only with [`ReadOptions::do_not_proxy`]: the bytes from `offset` on
    /// lie in a fragment `[begin, end)` held only by a store, at
    /// `location` (`file:///…` or an `http(s)://` URL). A READ_DONE with
    /// `offset = end` follows; fetch the object, decompress it per `codec`,
    /// check `sha1`, and read on from `end`. [`Client::read_direct`] does
    /// all of this.
    Fragment {
        begin: u64,
        end: u64,
        offset: u64,
        /// SHA-1 of the fragment's uncompressed bytes.
        sha1: [u8; 20],
        codec: Codec,
        location: String,
    },
    /// The read is over; always the last item.
    Done(ReadDone),
}

/// How a read ended (READ_DONE).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadDone {
    /// The next offset to read.
    pub offset: u64,
    /// The journal's write head when the read ended (0 if the broker did
    /// not say, as with JOURNAL_NOT_FOUND).
    pub write_head: u64,
    /// OK, OFFSET_NOT_YET_AVAILABLE (non-blocking read at the head),
    /// CANCELLED, or an error status.
    pub status: Status,
    /// The broker's message for a non-OK status; empty on OK.
    pub message: String,
    /// In a cluster on etcd, the revision of the route a refusing broker
    /// acted on (see [`Client::saw_route_revision`]); 0 otherwise.
    pub route_revision: u64,
}

impl ReadDone {
    /// `Ok` for OK, else the status as a [`ClientError`].
    pub fn check(&self) -> Result<(), ClientError> {
        if self.status == Status::OK {
            Ok(())
        } else {
            Err(ClientError::Status {
                status: self.status,
                message: self.message.clone(),
                append_reply: None,
            })
        }
    }
}

/// How a [`Client`] connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Send every journal request to the bootstrap broker (its shard for
    /// the journal), never to another broker of the route: see
    /// [`Client::connect_pinned`].
    pub pinned: bool,
    /// How long a connection with requests waiting may hear nothing from
    /// its broker before it is probed with a PING; requests fail with a
    /// `TimedOut` I/O error once it has heard nothing for twice this long.
    /// Default [`SILENCE_DEFAULT`].
    pub silence: Duration,
    /// How long [`Client::append`] and [`Client::append_with`] keep trying
    /// an append that failed because its journal's route is moving (a
    /// broker died or is handing its journals off): a broken connection or
    /// a status of [`is_failover`]. Each try looks the route up again.
    /// Zero (the default): no second try. An append retried after a broken
    /// connection may have committed the first time: with retries, appends
    /// are at least once unless they carry an expected offset or registers.
    pub retry_for: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            pinned: false,
            silence: SILENCE_DEFAULT,
            retry_for: Duration::ZERO,
        }
    }
}

/// Whether an error says the journal's route is moving, so that a retry
/// after looking the route up again can succeed: the broker is unreachable
/// or the connection broke, or the broker refused for want of a primary,
/// of members, or of its replicas' acknowledgements.
pub fn is_failover(e: &ClientError) -> bool {
    match e {
        ClientError::Io { .. } => true,
        ClientError::Status { status, .. } => matches!(
            *status,
            Status::NO_JOURNAL_PRIMARY_BROKER
                | Status::NOT_JOURNAL_PRIMARY_BROKER
                | Status::NOT_JOURNAL_BROKER
                | Status::INSUFFICIENT_JOURNAL_BROKERS
                | Status::WRONG_ROUTE
                | Status::REPLICATION_FAILED
                | Status::SHUTTING_DOWN
                | Status::PROPOSAL_MISMATCH
        ),
        _ => false,
    }
}

/// The first pause between tries of a failing append, doubling up to
/// [`RETRY_PAUSE_MAX`].
pub const RETRY_PAUSE_MIN: Duration = Duration::from_millis(50);
pub const RETRY_PAUSE_MAX: Duration = Duration::from_millis(500);

/// A client of one broker. Clones share connections and the route cache.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Conn>>>>;

/// What a client knows of a journal's route: the endpoint of the shard its
/// requests go to, and the etcd revision the route was read at. A route
/// forgotten (the broker was gone, or said the route moved) keeps its
/// revision, so that the next lookup asks for at least that revision and
/// a broker whose watch is behind waits instead of answering an older
/// route.
#[derive(Clone, Debug, Default)]
struct CachedRoute {
    endpoint: Option<String>,
    revision: u64,
}

struct Inner {
    /// The endpoints given to `connect`, as given (comma-separated).
    bootstrap: String,
    /// Each of them: admin requests and ROUTE go to the first that answers.
    bootstraps: Vec<String>,
    /// The one that answered last.
    current: std::sync::atomic::AtomicUsize,
    /// One slot per endpoint; the async lock makes concurrent first users
    /// share one connection attempt.
    conns: Mutex<HashMap<String, Slot>>,
    /// Journal name → its cached route.
    routes: Mutex<HashMap<String, CachedRoute>>,
    /// Endpoints whose requests failed on the network, until they answer.
    silent: silent::Silent,
    options: ClientOptions,
    /// HTTP agent of direct reads, made on first use.
    http: OnceLock<ureq::Agent>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("bootstrap", &self.inner.bootstrap)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Client {
    /// Connects to a broker through any of its shard endpoints (`host:port`),
    /// or to the first that answers of several (`a:7401,b:7401,c:7401`):
    /// later requests move to another of them when the one in use stops
    /// answering. Appends go to each journal's primary, wherever the route
    /// puts it.
    pub async fn connect(endpoint: &str) -> Result<Client, ClientError> {
        Client::connect_with(endpoint, ClientOptions::default()).await
    }

    /// Connects to one broker and keeps every journal request on it (on
    /// its shard for the journal): requests for journals it does not hold
    /// are proxied by it, or refused when the request says not to proxy.
    pub async fn connect_pinned(endpoint: &str) -> Result<Client, ClientError> {
        let options = ClientOptions {
            pinned: true,
            ..ClientOptions::default()
        };
        Client::connect_with(endpoint, options).await
    }

    /// Connects to a broker, as `options` say.
    pub async fn connect_with(
        endpoint: &str,
        options: ClientOptions,
    ) -> Result<Client, ClientError> {
        let bootstraps: Vec<String> = endpoint
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(String::from)
            .collect();
        if bootstraps.is_empty() {
            return Err(ClientError::Io {
                endpoint: endpoint.to_string(),
                source: Arc::new(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "no endpoint given",
                )),
            });
        }
        let client = Client {
            inner: Arc::new(Inner {
                bootstrap: endpoint.to_string(),
                bootstraps,
                current: std::sync::atomic::AtomicUsize::new(0),
                conns: Mutex::new(HashMap::new()),
                routes: Mutex::new(HashMap::new()),
                silent: silent::Silent::default(),
                options,
                http: OnceLock::new(),
            }),
        };
        client.bootstrap_conn().await?;
        Ok(client)
    }

    /// The endpoint this client was connected with.
    pub fn endpoint(&self) -> &str {
        &self.inner.bootstrap
    }

    /// The live connection to `endpoint`, opened if there is none.
    async fn conn(&self, endpoint: &str) -> Result<Arc<Conn>, ClientError> {
        let slot = lock(&self.inner.conns)
            .entry(endpoint.to_string())
            .or_default()
            .clone();
        let mut guard = slot.lock().await;
        if let Some(c) = guard.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let c = Conn::open(endpoint, self.inner.options.silence).await?;
        *guard = Some(c.clone());
        Ok(c)
    }

    /// The connection to the bootstrap endpoint in use, or to the next of
    /// them that answers when it does not. Endpoints marked silent are
    /// tried only after all the others.
    async fn bootstrap_conn(&self) -> Result<Arc<Conn>, ClientError> {
        use std::sync::atomic::Ordering;
        let all = &self.inner.bootstraps;
        let first = self.inner.current.load(Ordering::Relaxed);
        let order = (0..all.len()).map(|i| (first + i) % all.len());
        let (quiet, heard): (Vec<usize>, Vec<usize>) =
            order.partition(|&at| self.inner.silent.is_marked(&all[at]));
        let mut failed = None;
        for at in heard.into_iter().chain(quiet) {
            match self.conn(&all[at]).await {
                Ok(c) => {
                    self.inner.current.store(at, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e @ ClientError::Io { .. }) => {
                    self.inner.silent.mark(&all[at]);
                    failed = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(failed.expect("at least one endpoint"))
    }

    /// Moves on from the bootstrap endpoint in use to the next one.
    fn pass_over_bootstrap(&self) {
        use std::sync::atomic::Ordering;
        let n = self.inner.bootstraps.len();
        let at = self.inner.current.load(Ordering::Relaxed);
        self.inner.current.store((at + 1) % n, Ordering::Relaxed);
    }

    /// The bootstrap endpoint in use.
    fn current_bootstrap(&self) -> &str {
        let at = self
            .inner
            .current
            .load(std::sync::atomic::Ordering::Relaxed);
        &self.inner.bootstraps[at]
    }

    /// Asks the broker which shard owns `journal` (not cached), at no
    /// older etcd revision than this client has seen for the journal.
    pub async fn route(&self, journal: &str) -> Result<RouteInfo, ClientError> {
        let seen = self.route_revision(journal);
        self.route_at(journal, seen).await
    }

    /// Asks the broker which shard owns `journal`, read at etcd revision
    /// `min_revision` or later (Gazette's `min_etcd_revision`): a broker
    /// whose watch is behind waits for it, for a bounded time, and answers
    /// WRONG_ROUTE if it does not get there. 0 takes whatever it has.
    pub async fn route_at(
        &self,
        journal: &str,
        min_revision: u64,
    ) -> Result<RouteInfo, ClientError> {
        check_name_len(journal)?;
        let meta = Bytes::from(wire::encode_route(journal, min_revision));
        // A bootstrap broker that stopped answering is passed over.
        let mut tries = self.inner.bootstraps.len();
        let (conn, reply) = loop {
            let conn = self.bootstrap_conn().await?;
            match unary(&conn, Op::ROUTE, meta.clone(), Bytes::new()).await {
                Err(ClientError::Io { .. }) if tries > 1 => {
                    tries -= 1;
                    self.inner.silent.mark(&conn.endpoint);
                    self.pass_over_bootstrap();
                }
                r => break (conn, r?),
            }
        };
        self.inner.silent.clear(&conn.endpoint);
        let info: RouteInfo = admin_json(&conn, Op::ROUTE, reply)?;
        self.saw_route_revision(journal, info.revision);
        Ok(info)
    }

    /// The etcd revision this client last saw the journal's route at (0
    /// outside etcd, or before it asked).
    pub fn route_revision(&self, journal: &str) -> u64 {
        lock(&self.inner.routes)
            .get(journal)
            .map_or(0, |r| r.revision)
    }

    /// Notes that a broker answered about `journal` at etcd revision
    /// `revision`: later requests for the journal carry at least it.
    pub fn saw_route_revision(&self, journal: &str, revision: u64) {
        if revision == 0 {
            return;
        }
        let mut routes = lock(&self.inner.routes);
        if !routes.contains_key(journal) && routes.len() >= ROUTE_CACHE_JOURNALS_MAX {
            routes.clear();
        }
        let r = routes.entry(journal.to_string()).or_default();
        r.revision = r.revision.max(revision);
    }

    /// The connection to the shard owning `journal`, and the etcd revision
    /// its route was read at.
    async fn journal_conn(&self, journal: &str) -> Result<(Arc<Conn>, u64), ClientError> {
        let cached = lock(&self.inner.routes).get(journal).cloned();
        let (endpoint, revision) = match cached {
            Some(CachedRoute {
                endpoint: Some(e),
                revision,
            }) => (e, revision),
            _ => self.look_up(journal).await?,
        };
        match self.conn(&endpoint).await {
            Ok(c) => Ok((c, revision)),
            Err(e) => {
                self.forget_route(journal);
                self.inner.silent.mark(&endpoint);
                Err(e)
            }
        }
    }

    /// Asks where `journal`'s requests go and caches the answer; a route
    /// naming a broker this client stopped hearing from is asked again
    /// until it moves (see [`silent`]).
    async fn look_up(&self, journal: &str) -> Result<(String, u64), ClientError> {
        let mut route = self.route(journal).await?;
        let pinned = self.inner.options.pinned && !route.local_endpoint.is_empty();
        if !pinned {
            let at = reachable_endpoint(&route.endpoint, self.current_bootstrap());
            if self.inner.silent.is_marked(&at) {
                route = self.route_away_from(journal, &at, route).await;
            }
        }
        let target = if pinned {
            &route.local_endpoint
        } else {
            &route.endpoint
        };
        let endpoint = reachable_endpoint(target, self.current_bootstrap());
        let mut routes = lock(&self.inner.routes);
        if !routes.contains_key(journal) && routes.len() >= ROUTE_CACHE_JOURNALS_MAX {
            routes.clear();
        }
        let r = routes.entry(journal.to_string()).or_default();
        r.endpoint = Some(endpoint.clone());
        r.revision = r.revision.max(route.revision);
        Ok((endpoint, r.revision))
    }

    /// Asks `journal`'s route again every [`SILENT_ROUTE_POLL`] while it
    /// names `silent`, an endpoint marked silent, and returns the first
    /// that names another; `silent`'s route (`route`) once it answers a
    /// PING or once [`silent::Silent::wait_limit`] has passed since its
    /// mark (its mark is then cleared, so it is tried).
    #[allow(clippy::disallowed_methods)] // A wait on tokio's clock, as the silence limit is.
    async fn route_away_from(&self, journal: &str, silent: &str, route: RouteInfo) -> RouteInfo {
        let limit = silent::Silent::wait_limit(self.inner.options.silence);
        let since = self.inner.silent.since(silent);
        let give_up = since.unwrap_or_else(tokio::time::Instant::now) + limit;
        loop {
            if let Ok(r) = self.route(journal).await {
                if reachable_endpoint(&r.endpoint, self.current_bootstrap()) != silent {
                    return r;
                }
            }
            match tokio::time::timeout(SILENT_ROUTE_POLL, self.ping_endpoint(silent)).await {
                Ok(Ok(())) => break,
                Ok(Err(_)) => tokio::time::sleep(SILENT_ROUTE_POLL).await,
                Err(_) => {}
            }
            if tokio::time::Instant::now() >= give_up {
                break;
            }
        }
        self.inner.silent.clear(silent);
        route
    }

    /// PING on the connection to `endpoint`.
    async fn ping_endpoint(&self, endpoint: &str) -> Result<(), ClientError> {
        let conn = self.conn(endpoint).await?;
        let reply = unary(&conn, Op::PING, Bytes::new(), Bytes::new()).await?;
        expect_op(&conn, Op::PING, &reply, Op::PONG)
    }

    /// Drops a cached route's endpoint after a connection failure (the
    /// broker may have restarted with another shard count) or a refusal
    /// that says the route moved; its revision is kept.
    pub fn forget_route(&self, journal: &str) {
        if let Some(r) = lock(&self.inner.routes).get_mut(journal) {
            r.endpoint = None;
        }
    }

    fn on_journal_error<T>(
        &self,
        journal: &str,
        r: Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        if let Err(e) = &r {
            if let Some(reply) = e.append_reply() {
                self.saw_route_revision(journal, reply.route_revision);
            }
            // The broker is gone, or the route moved: ask ROUTE again.
            let moved = matches!(
                e.status(),
                Some(
                    Status::NOT_JOURNAL_PRIMARY_BROKER
                        | Status::NOT_JOURNAL_BROKER
                        | Status::WRONG_ROUTE
                )
            );
            if moved {
                self.forget_route(journal);
            }
            if let ClientError::Io { endpoint, .. } = e {
                self.forget_route(journal);
                self.inner.silent.mark(endpoint);
            }
        }
        r
    }

    /// PING: round trip to the bootstrap endpoint.
    pub async fn ping(&self) -> Result<(), ClientError> {
        // A broker that died a moment ago may still have accepted the
        // connection; its PING then fails, and the next endpoint is tried.
        let mut tries = self.inner.bootstraps.len();
        let (conn, reply) = loop {
            let conn = self.bootstrap_conn().await?;
            let payload = Bytes::from_static(b"rotary");
            match unary(&conn, Op::PING, Bytes::new(), payload).await {
                Err(ClientError::Io { .. }) if tries > 1 => {
                    tries -= 1;
                    self.pass_over_bootstrap();
                }
                r => break (conn, r?),
            }
        };
        let payload = Bytes::from_static(b"rotary");
        expect_op(&conn, Op::PING, &reply, Op::PONG)?;
        if reply.payload != payload {
            return Err(ClientError::Protocol {
                endpoint: conn.endpoint.clone(),
                source: ProtocolError::Wire(WireError::Truncated("PONG payload differs from PING")),
            });
        }
        Ok(())
    }

    /// Creates or replaces journals, each only if its spec is still at the
    /// revision given with it (`Some(0)`: only if the journal does not
    /// exist; `None`: whatever it is at), all or none: a revision that does
    /// not hold fails them all with `ETCD_TRANSACTION_FAILED`. Returns how
    /// many were applied.
    pub async fn apply_revised(
        &self,
        specs: &[(JournalSpec, Option<u64>)],
    ) -> Result<u64, ClientError> {
        #[derive(Deserialize)]
        struct Applied {
            applied: u64,
        }
        let entries: Vec<serde_json::Value> = specs
            .iter()
            .map(|(spec, revision)| {
                let mut v = serde_json::to_value(spec).expect("specs serialize to JSON");
                if let (Some(r), Some(o)) = (revision, v.as_object_mut()) {
                    o.insert("revision".into(), (*r).into());
                }
                v
            })
            .collect();
        let body = serde_json::to_vec(&entries).expect("JSON");
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::APPLY, Bytes::new(), body.into()).await?;
        let a: Applied = admin_json(&conn, Op::APPLY, reply)?;
        Ok(a.applied)
    }

    /// Creates or replaces journals. Returns how many were applied.
    pub async fn apply(&self, specs: &[JournalSpec]) -> Result<u64, ClientError> {
        #[derive(Deserialize)]
        struct Applied {
            applied: u64,
        }
        let body = serde_json::to_vec(specs).expect("specs serialize to JSON");
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::APPLY, Bytes::new(), body.into()).await?;
        let a: Applied = admin_json(&conn, Op::APPLY, reply)?;
        Ok(a.applied)
    }

    /// Lists journals whose labels match `selector` (text form, e.g.
    /// `app=orders,!retired`; empty lists all), sorted by name. The
    /// broker answers in pages of at most [`wire::LIST_PAGE_MAX`]
    /// journals, each asked for after the last name of the one before: a
    /// journal created or deleted while the pages are read may be missing
    /// or listed all the same, as with any listing that is not one answer.
    pub async fn list(&self, selector: &str) -> Result<Vec<JournalInfo>, ClientError> {
        // Check the text here so a typo is an error, not an empty list.
        let _ = crate::spec::LabelSelector::parse_journals(selector)?;
        let conn = self.bootstrap_conn().await?;
        let mut journals = Vec::new();
        let mut after = String::new();
        loop {
            let body = crate::wire::list_payload(selector, &after);
            let reply = unary(&conn, Op::LIST, Bytes::new(), body.into()).await?;
            let more = reply.flags & flag::NEXT_PAGE != 0;
            let page: Vec<JournalInfo> = admin_json(&conn, Op::LIST, reply)?;
            let next = match page.last() {
                Some(last) if more => Some(last.spec.name.clone()),
                _ => None,
            };
            journals.extend(page);
            match next {
                Some(next) => after = next,
                None => return Ok(journals),
            }
        }
    }

    async fn named_admin<T: serde::de::DeserializeOwned>(
        &self,
        op: Op,
        journal: &str,
    ) -> Result<T, ClientError> {
        check_name_len(journal)?;
        let r = async {
            let (conn, _) = self.journal_conn(journal).await?;
            let reply = unary(&conn, op, wire::encode_name(journal).into(), Bytes::new()).await?;
            admin_json(&conn, op, reply)
        }
        .await;
        self.on_journal_error(journal, r)
    }

    /// Deletes a journal and its local fragments.
    pub async fn delete(&self, journal: &str) -> Result<(), ClientError> {
        let _: serde_json::Value = self.named_admin(Op::DELETE, journal).await?;
        Ok(())
    }

    /// A journal's fragments, sorted by begin: every page of them
    /// ([`Client::fragments_page`]) in turn.
    pub async fn fragments(&self, journal: &str) -> Result<Vec<FragmentInfo>, ClientError> {
        let mut all = Vec::new();
        let mut from = 0;
        loop {
            let page = self
                .fragments_page(journal, from, wire::FRAGMENTS_PAGE_MAX)
                .await?;
            all.extend(page.fragments);
            match page.next {
                Some(next) => from = next,
                None => return Ok(all),
            }
        }
    }

    /// One page of a journal's fragments: at most `limit` (1 to
    /// [`wire::FRAGMENTS_PAGE_MAX`]) of those beginning at or after
    /// `from`, sorted by begin, plus any others beginning where the page's
    /// last one does (PROTOCOL §9.5).
    pub async fn fragments_page(
        &self,
        journal: &str,
        from: u64,
        limit: u32,
    ) -> Result<FragmentPage, ClientError> {
        check_name_len(journal)?;
        let body =
            serde_json::to_vec(&serde_json::json!({ "from": from, "limit": limit })).expect("JSON");
        let r = async {
            let (conn, _) = self.journal_conn(journal).await?;
            let reply = unary(
                &conn,
                Op::FRAGMENTS,
                wire::encode_name(journal).into(),
                body.into(),
            )
            .await?;
            let more = reply.flags & flag::NEXT_PAGE != 0;
            let fragments: Vec<FragmentInfo> = admin_json(&conn, Op::FRAGMENTS, reply)?;
            let next = match fragments.last() {
                Some(last) if more => Some(last.begin + 1),
                _ => None,
            };
            Ok(FragmentPage { fragments, next })
        }
        .await;
        self.on_journal_error(journal, r)
    }

    /// Seals the journal's open spool now; returns the sealed fragment, or
    /// `None` if the spool was empty.
    pub async fn seal(&self, journal: &str) -> Result<Option<FragmentInfo>, ClientError> {
        #[derive(Deserialize)]
        struct Sealed {
            sealed: Option<FragmentInfo>,
        }
        let s: Sealed = self.named_admin(Op::SEAL, journal).await?;
        Ok(s.sealed)
    }

    /// Moves the journal's write head to the end of its fragment index
    /// (after a broker lost its disk but the store kept the history, appends
    /// answer INDEX_HAS_GREATER_OFFSET until this is done). Returns the new
    /// write head.
    pub async fn reset_head(&self, journal: &str) -> Result<u64, ClientError> {
        let r: ResetHead = self.named_admin(Op::RESET_HEAD, journal).await?;
        Ok(r.write_head)
    }

    /// Deletes the store fragments older than their journal's
    /// `fragment.retention`, for every journal matching `selector` (text
    /// form; empty matches all) whose retention is non-zero. With `dry_run`
    /// nothing is deleted. Returns what was (or would be) removed.
    pub async fn prune(
        &self,
        selector: &str,
        dry_run: bool,
    ) -> Result<Vec<PrunedFragment>, ClientError> {
        let _ = crate::spec::LabelSelector::parse_journals(selector)?;
        let body = serde_json::to_vec(&serde_json::json!({
            "selector": selector,
            "dry_run": dry_run,
        }))
        .expect("JSON");
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::PRUNE, Bytes::new(), body.into()).await?;
        admin_json(&conn, Op::PRUNE, reply)
    }

    /// The cluster's brokers, with the journals each holds.
    pub async fn members(&self) -> Result<Vec<MemberInfo>, ClientError> {
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::MEMBERS, Bytes::new(), Bytes::new()).await?;
        admin_json(&conn, Op::MEMBERS, reply)
    }

    /// Marks broker `id` exiting: its journals move to other brokers, and
    /// it stops once it holds none (a cluster on etcd only).
    pub async fn drain(&self, id: &str) -> Result<(), ClientError> {
        let body = serde_json::to_vec(&serde_json::json!({ "id": id })).expect("JSON");
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::DRAIN, Bytes::new(), body.into()).await?;
        let _: serde_json::Value = admin_json(&conn, Op::DRAIN, reply)?;
        Ok(())
    }

    /// The broker's counters.
    pub async fn stats(&self) -> Result<serde_json::Value, ClientError> {
        let conn = self.bootstrap_conn().await?;
        let reply = unary(&conn, Op::STATS, Bytes::new(), Bytes::new()).await?;
        admin_json(&conn, Op::STATS, reply)
    }

    /// Appends `content` as one atomic span. Content up to
    /// [`APPEND_CHUNK_LEN`] goes in one frame; longer content is streamed in
    /// chunks of that size. Many appends may be in flight at once.
    ///
    /// Dropping the returned future before it completes rolls the append
    /// back if the broker has not yet been sent its last chunk.
    pub async fn append(
        &self,
        req: &AppendRequest,
        content: impl Into<Bytes>,
    ) -> Result<AppendReply, ClientError> {
        self.append_with(req, content, AppendOptions::default())
            .await
    }

    /// [`Client::append`] with options. Tried again while the journal's
    /// route moves, for up to [`ClientOptions::retry_for`].
    pub async fn append_with(
        &self,
        req: &AppendRequest,
        content: impl Into<Bytes>,
        options: AppendOptions,
    ) -> Result<AppendReply, ClientError> {
        let content: Bytes = content.into();
        self.retrying_failover(&req.journal, || {
            self.append_once(req, content.clone(), options)
        })
        .await
    }

    /// Runs `attempt` again while it fails for a reason a moving route
    /// explains ([`is_failover`]), looking the journal's route up again
    /// each time, for up to [`ClientOptions::retry_for`]; pauses from
    /// 50 ms doubling up to 500 ms.
    #[allow(clippy::disallowed_methods)] // The retry window is a tokio timer's, on tokio's clock.
    async fn retrying_failover<T, F, Fut>(
        &self,
        journal: &str,
        mut attempt: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let give_up = tokio::time::Instant::now() + self.inner.options.retry_for;
        let mut pause = RETRY_PAUSE_MIN;
        loop {
            match attempt().await {
                Err(e) if is_failover(&e) && tokio::time::Instant::now() + pause < give_up => {
                    self.forget_route(journal);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                r => return r,
            }
        }
    }

    async fn append_once(
        &self,
        req: &AppendRequest,
        content: Bytes,
        options: AppendOptions,
    ) -> Result<AppendReply, ClientError> {
        let first_flags = if options.do_not_proxy {
            flag::DO_NOT_PROXY
        } else {
            0
        };
        check_append_meta(req)?;
        let r = async {
            let (conn, revision) = self.journal_conn(&req.journal).await?;
            let meta = Bytes::from(req.encode_at(revision));
            let (tx, mut rx) = oneshot::channel();
            let id = conn.register(Waiter::Once(tx))?;
            let mut guard = AppendGuard::new(&conn, id);
            if content.len() <= APPEND_CHUNK_LEN {
                conn.send(Op::APPEND, first_flags, id, meta, content)
                    .await?;
            } else {
                let n = content.len().div_ceil(APPEND_CHUNK_LEN);
                for i in 0..n {
                    let chunk = content.slice(
                        i * APPEND_CHUNK_LEN..((i + 1) * APPEND_CHUNK_LEN).min(content.len()),
                    );
                    let last = i + 1 == n;
                    let flags = if last { 0 } else { flag::MORE };
                    if i == 0 {
                        conn.send(Op::APPEND, flags | first_flags, id, meta.clone(), chunk)
                            .await?;
                    } else {
                        conn.send(Op::APPEND_CHUNK, flags, id, Bytes::new(), chunk)
                            .await?;
                    }
                    guard.open = !last;
                    if !last {
                        // Refused early: stop sending (the guard ends the
                        // append with ABORT so the broker stops discarding).
                        if let Ok(reply) = rx.try_recv() {
                            return append_result(&conn, reply);
                        }
                    }
                }
            }
            let reply = (&mut rx).await.map_err(|_| conn.lost())?;
            append_result(&conn, reply)
        }
        .await;
        self.on_journal_error(&req.journal, r)
    }

    /// Appends everything `reader` yields until EOF as one atomic span,
    /// sending content as it is read. If the reader fails, the append is
    /// rolled back (APPEND_CHUNK with ABORT) and the reader's error returned.
    /// If the broker refuses the append early, reading stops.
    pub async fn append_stream<R>(
        &self,
        req: &AppendRequest,
        mut reader: R,
    ) -> Result<AppendReply, ClientError>
    where
        R: AsyncRead + Unpin,
    {
        check_append_meta(req)?;
        let r = async {
            let (conn, revision) = self.journal_conn(&req.journal).await?;
            let meta = Bytes::from(req.encode_at(revision));
            let (tx, mut rx) = oneshot::channel();
            let id = conn.register(Waiter::Once(tx))?;
            let mut guard = AppendGuard::new(&conn, id);
            let mut first = true;
            loop {
                let mut buf = BytesMut::with_capacity(APPEND_CHUNK_LEN);
                let filled = if first {
                    fill_chunk(&mut reader, &mut buf).await
                } else {
                    tokio::select! {
                        biased;
                        reply = &mut rx => {
                            let reply = reply.map_err(|_| conn.lost())?;
                            return append_result(&conn, reply);
                        }
                        f = fill_chunk(&mut reader, &mut buf) => f,
                    }
                };
                // On a reader error the guard sends ABORT if frames went out.
                let eof = filled.map_err(ClientError::Content)?;
                let flags = if eof { 0 } else { flag::MORE };
                let chunk = buf.freeze();
                if first {
                    conn.send(Op::APPEND, flags, id, meta.clone(), chunk)
                        .await?;
                    first = false;
                } else {
                    conn.send(Op::APPEND_CHUNK, flags, id, Bytes::new(), chunk)
                        .await?;
                }
                guard.open = !eof;
                if eof {
                    break;
                }
            }
            let reply = (&mut rx).await.map_err(|_| conn.lost())?;
            append_result(&conn, reply)
        }
        .await;
        self.on_journal_error(&req.journal, r)
    }

    /// Starts a read. `block` waits at the write head for more content;
    /// `metadata_only` answers with READ_DONE (offset, write head) only.
    /// Store-held history is streamed by the broker. Dropping the stream
    /// before its end cancels the read (CANCEL).
    pub async fn read(
        &self,
        req: &ReadRequest,
        block: bool,
        metadata_only: bool,
    ) -> Result<ReadStream, ClientError> {
        let options = ReadOptions {
            block,
            metadata_only,
            do_not_proxy: false,
        };
        self.read_with(req, options).await
    }

    /// Reads store-held history straight from the store: see
    /// [`DirectRead`]. `block` keeps tailing at the write head. Nothing is
    /// sent until the first item is asked for.
    pub fn read_direct(&self, req: &ReadRequest, block: bool) -> DirectRead {
        DirectRead::new(self.clone(), req, block)
    }

    /// The HTTP agent direct reads fetch fragments with.
    fn http_agent(&self) -> ureq::Agent {
        self.inner.http.get_or_init(fetch::http_agent).clone()
    }

    /// Starts a read with any flags (see [`ReadOptions`]). A read that
    /// cannot be sent (its broker is down, the route is being looked up
    /// again) is tried again while the journal's route moves, for up to
    /// [`ClientOptions::retry_for`]. Once sent, the stream's events are
    /// the broker's: a refusal arrives as its `READ_DONE`, and a
    /// connection lost mid-stream ends it. [`Client::read_direct`]
    /// follows a failover by itself, also mid-stream.
    pub async fn read_with(
        &self,
        req: &ReadRequest,
        options: ReadOptions,
    ) -> Result<ReadStream, ClientError> {
        self.retrying_failover(&req.journal, || self.read_once(req, options))
            .await
    }

    async fn read_once(
        &self,
        req: &ReadRequest,
        options: ReadOptions,
    ) -> Result<ReadStream, ClientError> {
        let ReadOptions {
            block,
            metadata_only,
            do_not_proxy,
        } = options;
        check_name_len(&req.journal)?;
        wire::check_offset(req.offset).map_err(ClientError::Offset)?;
        wire::check_end_offset(req.end_offset).map_err(ClientError::Offset)?;
        let r = async {
            let (conn, revision) = self.journal_conn(&req.journal).await?;
            let req = ReadRequest {
                route_revision: req.route_revision.max(revision),
                ..req.clone()
            };
            let (tx, rx) = mpsc::channel(READ_FRAMES_BUFFERED_MAX);
            let id = conn.register(Waiter::Stream(tx))?;
            let mut flags = 0;
            if block {
                flags |= flag::BLOCK;
            }
            if metadata_only {
                flags |= flag::METADATA_ONLY;
            }
            if do_not_proxy {
                flags |= flag::DO_NOT_PROXY;
            }
            let stream = ReadStream {
                conn: conn.clone(),
                id,
                rx,
                done: false,
            };
            conn.send(Op::READ, flags, id, req.encode().into(), Bytes::new())
                .await?;
            Ok(stream)
        }
        .await;
        self.on_journal_error(&req.journal, r)
    }
}

/// A fake broker's ROUTE answer, for tests: request `id`, `journal` owned
/// by the one shard at `endpoint`, appended to `out`.
#[cfg(test)]
pub(crate) fn fake_route_reply(out: &mut Vec<u8>, id: u64, journal: &str, endpoint: &str) {
    let body = serde_json::json!({
        "journal": journal, "shard": 0, "shards": 1, "endpoint": endpoint,
    });
    let body = serde_json::to_vec(&body).expect("json");
    wire::encode_frame(out, Op::ADMIN_REPLY, 0, Status::OK, id, &[], &body);
}

/// Replaces an unspecified host (`0.0.0.0`, `[::]`) in a routed endpoint by
/// the host the client reached the broker at.
fn reachable_endpoint(endpoint: &str, bootstrap: &str) -> String {
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return endpoint.to_string();
    };
    if host != "0.0.0.0" && host != "[::]" && host != "::" {
        return endpoint.to_string();
    }
    match bootstrap.rsplit_once(':') {
        Some((bhost, _)) => format!("{bhost}:{port}"),
        None => endpoint.to_string(),
    }
}

fn check_name_len(journal: &str) -> Result<(), ClientError> {
    if journal.len() > JOURNAL_NAME_LEN_MAX {
        return Err(ClientError::Invalid(SpecError::BadName {
            name: journal.chars().take(80).collect(),
            why: "must be 4 to 512 bytes long",
        }));
    }
    Ok(())
}

/// Refuses an append whose metadata would not fit a frame, with room for
/// the route revision it may be sent with.
fn check_append_meta(req: &AppendRequest) -> Result<(), ClientError> {
    check_name_len(&req.journal)?;
    wire::check_offset(req.expect_offset).map_err(ClientError::Offset)?;
    let sets = [
        &req.check_registers.include,
        &req.check_registers.exclude,
        &req.union_registers,
        &req.subtract_registers,
    ];
    let revision = std::mem::size_of::<u64>();
    let mut len = std::mem::size_of::<wire::AppendFixed>() + 2 + req.journal.len() + revision;
    for set in sets {
        len += 2 + set
            .iter()
            .map(|l| 4 + l.name.len() + l.value.len())
            .sum::<usize>();
    }
    if len > wire::META_LEN_MAX {
        return Err(ClientError::Invalid(SpecError::BadSpec {
            name: req.journal.clone(),
            why: format!(
                "append metadata of {len} bytes exceeds {}",
                wire::META_LEN_MAX
            ),
        }));
    }
    Ok(())
}

/// Reads up to [`APPEND_CHUNK_LEN`] bytes: waits for the first byte, then
/// keeps reading while more arrives within [`APPEND_STREAM_COALESCE`].
/// Returns whether the reader reached EOF.
async fn fill_chunk<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut BytesMut) -> io::Result<bool> {
    use bytes::BufMut;
    loop {
        let room = APPEND_CHUNK_LEN - buf.len();
        if room == 0 {
            return Ok(false);
        }
        let mut limited = (&mut *buf).limit(room);
        let n = if buf_is_empty(&limited) {
            reader.read_buf(&mut limited).await?
        } else {
            // `read_buf` is cancel safe: a timed-out read took no bytes.
            match tokio::time::timeout(APPEND_STREAM_COALESCE, reader.read_buf(&mut limited)).await
            {
                Ok(r) => r?,
                Err(_) => return Ok(false),
            }
        };
        if n == 0 {
            return Ok(true);
        }
    }
}

fn buf_is_empty(limited: &bytes::buf::Limit<&mut BytesMut>) -> bool {
    limited.get_ref().is_empty()
}

/// Ends an append that did not finish normally: forgets its request id and,
/// if frames with MORE went out, sends APPEND_CHUNK with ABORT so the broker
/// rolls it back (or, if it already refused it, stops discarding chunks).
struct AppendGuard<'a> {
    conn: &'a Arc<Conn>,
    id: u64,
    /// The broker has an APPEND with MORE but not yet its last chunk.
    open: bool,
}

impl<'a> AppendGuard<'a> {
    fn new(conn: &'a Arc<Conn>, id: u64) -> Self {
        AppendGuard {
            conn,
            id,
            open: false,
        }
    }
}

impl Drop for AppendGuard<'_> {
    fn drop(&mut self) {
        self.conn.unregister(self.id);
        if self.open {
            self.conn
                .send_control(Op::APPEND_CHUNK, flag::ABORT, self.id);
        }
    }
}

/// Sends one request and waits for its single reply frame.
async fn unary(
    conn: &Arc<Conn>,
    op: Op,
    meta: Bytes,
    payload: Bytes,
) -> Result<Reply, ClientError> {
    let (tx, rx) = oneshot::channel();
    let id = conn.register(Waiter::Once(tx))?;
    struct Forget<'a>(&'a Conn, u64);
    impl Drop for Forget<'_> {
        fn drop(&mut self) {
            self.0.unregister(self.1);
        }
    }
    let _forget = Forget(conn, id);
    conn.send(op, 0, id, meta, payload).await?;
    rx.await.map_err(|_| conn.lost())?
}

fn status_error(reply: &Reply, append_reply: Option<AppendReply>) -> ClientError {
    ClientError::Status {
        status: reply.status,
        message: reply.message(),
        append_reply: append_reply.map(Box::new),
    }
}

/// Checks that `reply` is `want` (or an ERROR frame, turned into its status).
fn expect_op(conn: &Conn, request: Op, reply: &Reply, want: Op) -> Result<(), ClientError> {
    if reply.op == Op::ERROR {
        return Err(status_error(reply, None));
    }
    if reply.op != want {
        return Err(ClientError::Protocol {
            endpoint: conn.endpoint.clone(),
            source: ProtocolError::UnexpectedOp {
                request,
                got: reply.op,
            },
        });
    }
    Ok(())
}

/// Decodes an ADMIN_REPLY's JSON, or its status as an error.
fn admin_json<T: serde::de::DeserializeOwned>(
    conn: &Conn,
    request: Op,
    reply: Reply,
) -> Result<T, ClientError> {
    expect_op(conn, request, &reply, Op::ADMIN_REPLY)?;
    if reply.status != Status::OK {
        return Err(status_error(&reply, None));
    }
    serde_json::from_slice(&reply.payload).map_err(|e| ClientError::Protocol {
        endpoint: conn.endpoint.clone(),
        source: ProtocolError::Json(Arc::new(e)),
    })
}

fn append_result(
    conn: &Conn,
    reply: Result<Reply, ClientError>,
) -> Result<AppendReply, ClientError> {
    let reply = reply?;
    expect_op(conn, Op::APPEND, &reply, Op::APPEND_REPLY)?;
    let decoded = if reply.meta.is_empty() && reply.status != Status::OK {
        None
    } else {
        match AppendReply::decode(&reply.meta) {
            Ok(r) => Some(r),
            Err(e) if reply.status == Status::OK => {
                return Err(ClientError::Protocol {
                    endpoint: conn.endpoint.clone(),
                    source: e.into(),
                })
            }
            Err(_) => None,
        }
    };
    if reply.status != Status::OK {
        return Err(status_error(&reply, decoded));
    }
    Ok(decoded.expect("decoded on OK"))
}

/// Replies to one READ: [`ReadEvent::Data`] items, then one
/// [`ReadEvent::Done`]. Also a `futures_core::Stream`.
pub struct ReadStream {
    conn: Arc<Conn>,
    id: u64,
    rx: mpsc::Receiver<Result<Reply, ClientError>>,
    done: bool,
}

impl std::fmt::Debug for ReadStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadStream")
            .field("endpoint", &self.conn.endpoint)
            .field("id", &self.id)
            .field("done", &self.done)
            .finish()
    }
}

impl ReadStream {
    /// The next item; `None` after [`ReadEvent::Done`] or an error.
    pub async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// Cancels the read (CANCEL) and waits for its READ_DONE, discarding
    /// data still in flight. Returns the final READ_DONE (usually
    /// CANCELLED; OK if the read ended first).
    pub async fn cancel(mut self) -> Result<ReadDone, ClientError> {
        if self.done {
            return Err(ClientError::Protocol {
                endpoint: self.conn.endpoint.clone(),
                source: ProtocolError::Truncated,
            });
        }
        self.conn.send_control(Op::CANCEL, 0, self.id);
        loop {
            match self.next().await {
                Some(Ok(ReadEvent::Data { .. } | ReadEvent::Fragment { .. })) => continue,
                Some(Ok(ReadEvent::Done(d))) => return Ok(d),
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(ClientError::Protocol {
                        endpoint: self.conn.endpoint.clone(),
                        source: ProtocolError::Truncated,
                    })
                }
            }
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<ReadEvent, ClientError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let item = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Err(self.conn.lost())
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Err(e)
            }
            Poll::Ready(Some(Ok(reply))) => self.event(reply),
        };
        Poll::Ready(Some(item))
    }

    fn protocol(&self, source: ProtocolError) -> ClientError {
        ClientError::Protocol {
            endpoint: self.conn.endpoint.clone(),
            source,
        }
    }

    fn event(&mut self, reply: Reply) -> Result<ReadEvent, ClientError> {
        match reply.op {
            Op::READ_DATA => {
                if reply.status != Status::OK {
                    self.done = true;
                    return Err(status_error(&reply, None));
                }
                match wire::decode_fixed::<wire::ReadData>(&reply.meta, "read data offset") {
                    Ok(d) => Ok(ReadEvent::Data {
                        offset: d.offset.get(),
                        content: reply.payload,
                    }),
                    Err(e) => {
                        self.done = true;
                        Err(self.protocol(e.into()))
                    }
                }
            }
            Op::READ_FRAGMENT => {
                let r = self.fragment_event(&reply);
                if r.is_err() {
                    self.done = true;
                }
                r
            }
            Op::READ_DONE => {
                self.done = true;
                let (offset, write_head, route_revision) = if reply.meta.is_empty()
                    && reply.status != Status::OK
                {
                    (0, 0, 0)
                } else {
                    match wire::decode_read_done(&reply.meta) {
                        Ok((d, r)) => (d.offset.get(), d.write_head.get(), r),
                        Err(e) if reply.status == Status::OK => return Err(self.protocol(e.into())),
                        Err(_) => (0, 0, 0),
                    }
                };
                let message = if reply.status == Status::OK {
                    String::new()
                } else {
                    reply.message()
                };
                Ok(ReadEvent::Done(ReadDone {
                    offset,
                    write_head,
                    status: reply.status,
                    message,
                    route_revision,
                }))
            }
            Op::ERROR => {
                self.done = true;
                Err(status_error(&reply, None))
            }
            got => {
                self.done = true;
                Err(self.protocol(ProtocolError::UnexpectedOp {
                    request: Op::READ,
                    got,
                }))
            }
        }
    }
}

impl ReadStream {
    fn fragment_event(&self, reply: &Reply) -> Result<ReadEvent, ClientError> {
        if reply.status != Status::OK {
            return Err(status_error(reply, None));
        }
        let f = wire::decode_fixed::<wire::ReadFragment>(&reply.meta, "read fragment")
            .map_err(|e| self.protocol(e.into()))?;
        let (begin, end, offset) = (f.begin.get(), f.end.get(), f.offset.get());
        if !(begin <= offset && offset < end) {
            return Err(self.protocol(ProtocolError::FragmentRange { begin, end, offset }));
        }
        let codec = wire::codec_from_code(f.codec)
            .ok_or_else(|| self.protocol(ProtocolError::UnknownCodec(f.codec)))?;
        let location = std::str::from_utf8(&reply.payload)
            .map_err(|_| self.protocol(ProtocolError::LocationNotUtf8))?
            .to_string();
        Ok(ReadEvent::Fragment {
            begin,
            end,
            offset,
            sha1: f.sha1,
            codec,
            location,
        })
    }
}

impl futures_core::Stream for ReadStream {
    type Item = Result<ReadEvent, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl Drop for ReadStream {
    fn drop(&mut self) {
        if !self.done {
            self.conn.unregister(self.id);
            self.conn.send_control(Op::CANCEL, 0, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_hosts_are_replaced() {
        assert_eq!(
            reachable_endpoint("0.0.0.0:7402", "10.0.0.5:7401"),
            "10.0.0.5:7402"
        );
        assert_eq!(
            reachable_endpoint("[::]:7402", "broker-1:7401"),
            "broker-1:7402"
        );
        assert_eq!(
            reachable_endpoint("127.0.0.1:7402", "localhost:7401"),
            "127.0.0.1:7402"
        );
    }

    #[test]
    fn oversized_append_metadata_is_refused() {
        let mut req = AppendRequest {
            journal: "a/b/c".into(),
            ..Default::default()
        };
        assert!(check_append_meta(&req).is_ok());
        for i in 0..100 {
            req.union_registers
                .add(format!("k{i}"), "v".repeat(1000))
                .unwrap();
        }
        assert!(matches!(
            check_append_meta(&req),
            Err(ClientError::Invalid(_))
        ));
        req.union_registers = Default::default();
        req.journal = "x".repeat(600);
        assert!(matches!(
            check_append_meta(&req),
            Err(ClientError::Invalid(_))
        ));
    }

    #[test]
    fn append_offsets_beyond_i64_are_refused() {
        let mut req = AppendRequest {
            journal: "a/b/c".into(),
            expect_offset: Some(wire::OFFSET_MAX),
            ..Default::default()
        };
        assert!(check_append_meta(&req).is_ok());
        for offset in [wire::OFFSET_MAX + 1, u64::MAX] {
            req.expect_offset = Some(offset);
            let err = check_append_meta(&req).unwrap_err();
            assert!(
                matches!(err, ClientError::Offset(WireError::OffsetTooLarge(o)) if o == offset),
                "{err}"
            );
            assert!(!err.is_retryable());
            assert_eq!(
                err.to_string(),
                format!("invalid request: offset {offset} exceeds 9223372036854775807 (i64::MAX), the largest offset a request carries")
            );
        }
    }

    /// A fake broker on loopback: answers APPENDs out of order and checks
    /// that the client pipelines (several appends in flight before any
    /// reply) and reassembles chunked content.
    #[tokio::test]
    async fn appends_are_pipelined_and_replies_matched_by_id() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server_addr = addr.clone();
        let server = tokio::spawn(pipelining_broker(listener, server_addr));
        let client = Client::connect(&addr).await.unwrap();
        let req = AppendRequest {
            journal: "test/pipeline".into(),
            ..Default::default()
        };
        let sizes = [10usize, APPEND_CHUNK_LEN * 2 + 7, 1, 5000];
        let futs = sizes.iter().map(|&n| {
            let client = client.clone();
            let req = req.clone();
            async move { client.append(&req, vec![n as u8; n]).await.unwrap() }
        });
        let replies =
            tokio::time::timeout(Duration::from_secs(20), futures_join_all(futs.collect()))
                .await
                .expect(
                    "appends are pipelined: the fake broker replies only after all four arrive",
                );
        for (reply, &n) in replies.iter().zip(&sizes) {
            assert_eq!(reply.end - reply.begin, n as u64);
        }
        let received = server.await.unwrap();
        let mut got: Vec<usize> = received.iter().map(|c| c.len()).collect();
        got.sort();
        let mut want = sizes.to_vec();
        want.sort();
        assert_eq!(got, want);
        for c in &received {
            assert!(c.iter().all(|&b| b == c.len() as u8));
        }
    }

    /// The fake broker of `appends_are_pipelined_and_replies_matched_by_id`:
    /// takes four whole appends, then replies to them in reverse order.
    /// Returns their contents.
    async fn pipelining_broker(
        listener: tokio::net::TcpListener,
        server_addr: String,
    ) -> Vec<Vec<u8>> {
        use tokio::io::AsyncWriteExt;
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut appends: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut finished: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut tmp = vec![0u8; 1 << 16];
        while finished.len() < 4 {
            let n = sock.read(&mut tmp).await.unwrap();
            assert!(n > 0);
            buf.extend_from_slice(&tmp[..n]);
            while let Some((f, used)) = wire::decode_frame(&buf, wire::BODY_LEN_MAX).unwrap() {
                let mut out = Vec::new();
                match f.op {
                    Op::ROUTE => {
                        let name = wire::decode_name(f.meta).unwrap();
                        let body = serde_json::json!({"journal": name, "shard": 0, "shards": 1, "endpoint": server_addr});
                        wire::encode_frame(
                            &mut out,
                            Op::ADMIN_REPLY,
                            0,
                            Status::OK,
                            f.request_id,
                            &[],
                            body.to_string().as_bytes(),
                        );
                    }
                    Op::APPEND => {
                        AppendRequest::decode(f.meta).unwrap();
                        appends.insert(f.request_id, f.payload.to_vec());
                        if f.flags & flag::MORE == 0 {
                            finished.push((f.request_id, appends.remove(&f.request_id).unwrap()));
                        }
                    }
                    Op::APPEND_CHUNK => {
                        appends
                            .get_mut(&f.request_id)
                            .unwrap()
                            .extend_from_slice(f.payload);
                        if f.flags & flag::MORE == 0 {
                            finished.push((f.request_id, appends.remove(&f.request_id).unwrap()));
                        }
                    }
                    other => panic!("unexpected {other:?}"),
                }
                sock.write_all(&out).await.unwrap();
                buf.drain(..used);
            }
        }
        // Reply in reverse order; the length tells which append it was.
        let mut head = 0;
        for (id, content) in finished.iter().rev() {
            let reply = AppendReply {
                begin: head,
                end: head + content.len() as u64,
                write_head: head + content.len() as u64,
                sha1: [0; 20],
                registers: Default::default(),
                route_revision: 0,
            };
            head = reply.end;
            let mut out = Vec::new();
            wire::encode_frame(
                &mut out,
                Op::APPEND_REPLY,
                0,
                Status::OK,
                *id,
                &reply.encode(),
                &[],
            );
            sock.write_all(&out).await.unwrap();
        }
        finished.into_iter().map(|(_, c)| c).collect::<Vec<_>>()
    }

    /// Reads one whole frame from a fake broker's socket.
    async fn next_frame(
        sock: &mut tokio::net::TcpStream,
        buf: &mut Vec<u8>,
    ) -> Option<(Op, u64, Vec<u8>)> {
        loop {
            if let Some((f, used)) = wire::decode_frame(buf, wire::BODY_LEN_MAX).unwrap() {
                let out = (f.op, f.request_id, f.payload.to_vec());
                buf.drain(..used);
                return Some(out);
            }
            let mut tmp = [0u8; 4096];
            let n = sock.read(&mut tmp).await.unwrap();
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&tmp[..n]);
        }
    }

    /// A broken connection fails the requests in flight with a retryable
    /// A refusal saying the route moved is retryable for this client (it
    /// asks ROUTE again first); other statuses keep their own rule.
    #[test]
    fn moved_routes_are_retryable_for_the_client() {
        let err = |status| ClientError::Status {
            status,
            message: String::new(),
            append_reply: None,
        };
        for status in [
            Status::NOT_JOURNAL_PRIMARY_BROKER,
            Status::NOT_JOURNAL_BROKER,
        ] {
            assert!(!status.is_retryable());
            assert!(err(status).is_retryable(), "{status:?}");
        }
        for status in [Status::WRONG_ROUTE, Status::REPLICATION_FAILED] {
            assert!(err(status).is_retryable(), "{status:?}");
        }
        for status in [Status::JOURNAL_NOT_FOUND, Status::WRONG_APPEND_OFFSET] {
            assert!(!err(status).is_retryable(), "{status:?}");
        }
    }

    /// I/O error; the next request opens a new connection. An ERROR frame
    /// is the final reply of the request it names.
    #[tokio::test]
    async fn reconnects_after_the_broker_closes_and_maps_error_frames() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            // First connection: take a PING, close without answering.
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let (op, _, _) = next_frame(&mut sock, &mut buf).await.unwrap();
            assert_eq!(op, Op::PING);
            drop(sock);
            // Second connection: answer STATS with ERROR, then PING.
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            for _ in 0..2 {
                let (op, id, payload) = next_frame(&mut sock, &mut buf).await.unwrap();
                let mut out = Vec::new();
                match op {
                    Op::STATS => wire::encode_frame(
                        &mut out,
                        Op::ERROR,
                        0,
                        Status::BAD_REQUEST,
                        id,
                        &[],
                        b"no stats today",
                    ),
                    Op::PING => {
                        wire::encode_frame(&mut out, Op::PONG, 0, Status::OK, id, &[], &payload)
                    }
                    other => panic!("unexpected {other:?}"),
                }
                sock.write_all(&out).await.unwrap();
            }
        });
        let client = Client::connect(&addr).await.unwrap();
        let err = client.ping().await.unwrap_err();
        assert!(matches!(err, ClientError::Io { .. }), "{err}");
        assert!(err.is_retryable());
        assert_eq!(err.status(), None);
        let err = client.stats().await.unwrap_err();
        assert_eq!(err.status(), Some(Status::BAD_REQUEST));
        assert!(err.to_string().contains("no stats today"), "{err}");
        client.ping().await.unwrap();
        server.await.unwrap();
    }

    /// A fake broker that reads requests and answers none of them, nor
    /// PINGs unless `pongs`. Returns its address and the request ids of the
    /// PINGs it got so far.
    async fn silent_broker(pongs: bool) -> (String, Arc<Mutex<Vec<u64>>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let pings = Arc::new(Mutex::new(Vec::new()));
        let seen = pings.clone();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut tmp = vec![0u8; 1 << 16];
            loop {
                let n = sock.read(&mut tmp).await.unwrap();
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&tmp[..n]);
                while let Some((f, used)) = wire::decode_frame(&buf, wire::BODY_LEN_MAX).unwrap() {
                    if f.op == Op::PING {
                        lock(&seen).push(f.request_id);
                        if pongs {
                            let mut out = Vec::new();
                            let id = f.request_id;
                            wire::encode_frame(&mut out, Op::PONG, 0, Status::OK, id, &[], &[]);
                            sock.write_all(&out).await.unwrap();
                        }
                    }
                    buf.drain(..used);
                }
            }
        });
        (addr, pings)
    }

    fn quick(silence: Duration) -> ClientOptions {
        ClientOptions {
            silence,
            ..ClientOptions::default()
        }
    }

    /// A broker that stops answering fails the requests waiting on it
    /// after twice the silence, having been sent one PING.
    #[tokio::test]
    async fn a_broker_that_answers_nothing_fails_waiting_requests_in_time() {
        let (addr, pings) = silent_broker(false).await;
        let silence = Duration::from_millis(150);
        let client = Client::connect_with(&addr, quick(silence)).await.unwrap();
        let started = rotary_proto::clock::now();
        let err = tokio::time::timeout(Duration::from_secs(10), client.stats())
            .await
            .expect("the silent broker is given up on well before 10 s")
            .unwrap_err();
        let waited = rotary_proto::clock::elapsed(started);
        let ClientError::Io { source, .. } = &err else {
            panic!("want an I/O error, got {err:?}");
        };
        assert_eq!(source.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(
            err.to_string().contains("not even an answer to a PING"),
            "{err}"
        );
        assert!(err.is_retryable());
        // Two silences from when the reader started waiting, just before.
        assert!(waited >= silence * 3 / 2, "given up after {waited:?}");
        assert_eq!(*lock(&pings), vec![u64::MAX]);
        // The connection is gone; the next request opens another, which
        // the fake broker never serves: it is given up on the same way.
        assert!(client.stats().await.is_err());
    }

    /// A broker that answers PINGs is alive however long a request waits
    /// (a blocking read at the write head waits for as long as it takes).
    #[tokio::test]
    async fn a_broker_that_answers_pings_keeps_requests_waiting() {
        let (addr, pings) = silent_broker(true).await;
        // Long enough that a PONG delayed by a loaded machine still counts.
        let silence = Duration::from_millis(400);
        let client = Client::connect_with(&addr, quick(silence)).await.unwrap();
        let waited = tokio::time::timeout(silence * 8, client.stats()).await;
        assert!(waited.is_err(), "the request still waits: {waited:?}");
        let pings = lock(&pings).clone();
        assert!(
            pings.len() >= 3,
            "probed again after each answer: {pings:?}"
        );
        assert!(pings.iter().all(|&id| id == u64::MAX));
    }

    /// A fake bootstrap broker answering ROUTE for any journal: its first
    /// `first_n` answers name `first`, the rest `then`. Returns its address
    /// and how many ROUTEs it answered.
    async fn router(first: String, first_n: usize, then: String) -> (String, Arc<Mutex<usize>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let asked = Arc::new(Mutex::new(0usize));
        let count = asked.clone();
        tokio::spawn(async move {
            loop {
                let (mut sock, _) = listener.accept().await.unwrap();
                let (first, then, count) = (first.clone(), then.clone(), count.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    while let Some((op, id, payload)) = next_frame(&mut sock, &mut buf).await {
                        let mut out = Vec::new();
                        if op == Op::PING {
                            wire::encode_frame(
                                &mut out,
                                Op::PONG,
                                0,
                                Status::OK,
                                id,
                                &[],
                                &payload,
                            );
                        } else {
                            assert_eq!(op, Op::ROUTE);
                            let n = {
                                let mut c = lock(&count);
                                *c += 1;
                                *c
                            };
                            let endpoint = if n <= first_n { &first } else { &then };
                            fake_route_reply(&mut out, id, "j", endpoint);
                        }
                        sock.write_all(&out).await.unwrap();
                    }
                });
            }
        });
        (addr, asked)
    }

    /// A journal whose primary went silent: while the route still names
    /// it, the client asks the route again (and PINGs the silent broker)
    /// instead of sending it the request again, and goes where the route
    /// moves to.
    #[tokio::test]
    async fn a_route_naming_a_silent_broker_is_asked_again_until_it_moves() {
        let (silent, pings) = silent_broker(false).await;
        let (next, _) = silent_broker(true).await;
        let (addr, asked) = router(silent.clone(), 4, next.clone()).await;
        // Long enough that the wait for the route never reaches its limit.
        let client = Client::connect_with(&addr, quick(Duration::from_secs(30)))
            .await
            .unwrap();
        client.inner.silent.mark(&silent);
        let (conn, _) = client.journal_conn("j").await.unwrap();
        assert_eq!(conn.endpoint, next, "the route moved to the other broker");
        assert_eq!(*lock(&asked), 5, "asked until the fifth answer moved");
        let pings = lock(&pings).clone();
        assert!(
            (1..=4).contains(&pings.len()),
            "the silent broker got PINGs only, one per answer naming it: {pings:?}"
        );
        assert!(client.inner.silent.is_marked(&silent), "it never answered");
        // A silent broker that answers a PING is used again.
        let (back, _) = silent_broker(true).await;
        let (addr, _) = router(back.clone(), usize::MAX, next).await;
        let client = Client::connect_with(&addr, quick(Duration::from_secs(30)))
            .await
            .unwrap();
        client.inner.silent.mark(&back);
        let (conn, _) = client.journal_conn("j").await.unwrap();
        assert_eq!(conn.endpoint, back);
        assert!(!client.inner.silent.is_marked(&back));
    }

    /// An idle connection (nothing waiting) is not probed.
    #[tokio::test]
    async fn an_idle_connection_is_not_probed() {
        let (addr, pings) = silent_broker(false).await;
        let client = Client::connect_with(&addr, quick(Duration::from_millis(50)))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(lock(&pings).is_empty());
        drop(client);
    }

    async fn futures_join_all<F: std::future::Future + Send + 'static>(
        futs: Vec<F>,
    ) -> Vec<F::Output>
    where
        F::Output: Send + 'static,
    {
        let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.unwrap());
        }
        out
    }
}
