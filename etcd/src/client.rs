//! The connection to etcd (several endpoints, failover) and the KV calls.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::error::Error;
use crate::pb::etcdserverpb as rpc;
use crate::pb::etcdserverpb::kv_client::KvClient;
use crate::pb::mvccpb::KeyValue;
use crate::txn::{Txn, TxnResponse};

/// Largest message the client decodes. etcd itself refuses requests over
/// 1.5 MiB by default, but a range page can be larger than one request.
pub(crate) const DECODED_MESSAGE_BYTES_MAX: usize = 64 << 20;

/// How the client talks to etcd. `Default` gives values suited to a cluster
/// on a local network.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long to wait for one endpoint to accept a connection.
    pub connect_timeout: Duration,
    /// How long a unary call (range, put, txn, lease grant, ...) may take.
    pub request_timeout: Duration,
    /// HTTP/2 ping interval on a connection with open streams, so that a
    /// watch on a dead connection fails instead of hanging. etcd refuses
    /// pings more often than every 5 s (`--grpc-keepalive-min-time`).
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered before the connection is dropped.
    pub keep_alive_timeout: Duration,
    /// Keys per page when ranging over a prefix.
    pub range_page_keys_max: i64,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            range_page_keys_max: 1000,
        }
    }
}

/// A client of one etcd cluster, reachable through any of several endpoints.
///
/// Cheap to clone (clones share one connection). Calls go to one endpoint
/// at a time; when a call fails in a way that says the endpoint is unusable
/// (unavailable, timed out, stream broken), the next call connects to the
/// next endpoint in the list. Reads (`get`, `range*`) are retried once on
/// each other endpoint before they fail; writes are never retried here,
/// because a write whose answer was lost may have been applied: the caller
/// decides (a guarded [`Txn`] makes a retry safe).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoints", &self.endpoints().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

struct Inner {
    endpoints: Vec<(String, Endpoint)>,
    options: ClientOptions,
    conn: tokio::sync::Mutex<ConnState>,
}

struct ConnState {
    /// Endpoint to try first on the next connect.
    next: usize,
    generation: u64,
    current: Option<Connected>,
}

/// One live connection and which endpoint it is to.
#[derive(Clone)]
pub(crate) struct Connected {
    pub(crate) channel: Channel,
    generation: u64,
    index: usize,
}

/// A key read from etcd, with the store revision it was read at.
#[derive(Clone, Debug, PartialEq)]
pub struct GetResponse {
    /// The key, or `None` when it does not exist.
    pub kv: Option<KeyValue>,
    /// The store's revision when etcd answered.
    pub revision: i64,
}

/// Keys read from etcd, all at one store revision.
#[derive(Clone, Debug, PartialEq)]
pub struct RangeResponse {
    /// The keys, in key order.
    pub kvs: Vec<KeyValue>,
    /// The store revision every page was read at.
    pub revision: i64,
}

/// What a put did.
#[derive(Clone, Debug, PartialEq)]
pub struct PutResponse {
    /// The revision of the put.
    pub revision: i64,
}

/// What a delete did.
#[derive(Clone, Debug, PartialEq)]
pub struct DeleteResponse {
    /// How many keys it deleted.
    pub deleted: i64,
    /// The store's revision after the delete (unchanged if nothing was deleted).
    pub revision: i64,
}

impl Client {
    /// Connects to the first of `endpoints` (`http://HOST:PORT`, etcd's
    /// client URLs) that accepts a connection, trying each in turn.
    ///
    /// Must be called inside a tokio runtime; the connection's tasks run on it.
    pub async fn connect<S: AsRef<str>>(
        endpoints: &[S],
        options: ClientOptions,
    ) -> Result<Client, Error> {
        if endpoints.is_empty() {
            return Err(Error::NoEndpoints);
        }
        let mut parsed = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let endpoint = endpoint.as_ref().trim();
            parsed.push((endpoint.to_owned(), make_endpoint(endpoint, &options)?));
        }
        let client = Client {
            inner: Arc::new(Inner {
                endpoints: parsed,
                options,
                conn: tokio::sync::Mutex::new(ConnState {
                    next: 0,
                    generation: 0,
                    current: None,
                }),
            }),
        };
        client.connected().await?;
        Ok(client)
    }

    /// The options the client was made with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> impl Iterator<Item = &str> {
        self.inner.endpoints.iter().map(|(name, _)| name.as_str())
    }

    /// The current connection, connecting if there is none.
    pub(crate) async fn connected(&self) -> Result<Connected, Error> {
        let mut state = self.inner.conn.lock().await;
        if let Some(current) = &state.current {
            return Ok(current.clone());
        }
        let count = self.inner.endpoints.len();
        let mut last_error = None;
        for attempt in 0..count {
            let index = (state.next + attempt) % count;
            let (name, endpoint) = &self.inner.endpoints[index];
            match endpoint.connect().await {
                Ok(channel) => {
                    state.generation += 1;
                    state.next = index;
                    let connected = Connected {
                        channel,
                        generation: state.generation,
                        index,
                    };
                    state.current = Some(connected.clone());
                    tracing::debug!(endpoint = %name, "connected to etcd");
                    return Ok(connected);
                }
                Err(error) => {
                    tracing::debug!(endpoint = %name, %error, "cannot connect to etcd");
                    last_error = Some(error);
                }
            }
        }
        let source = last_error.expect("at least one endpoint was tried");
        Err(Error::Connect {
            endpoints: self.endpoints().collect::<Vec<_>>().join(","),
            source,
        })
    }

    /// Drops `conn` if it is still the current connection, so that the next
    /// call connects again, starting with the next endpoint.
    pub(crate) async fn connection_failed(&self, conn: &Connected) {
        let mut state = self.inner.conn.lock().await;
        if state.current.as_ref().map(|c| c.generation) == Some(conn.generation) {
            state.current = None;
            state.next = (conn.index + 1) % self.inner.endpoints.len();
            tracing::debug!(endpoint = %self.inner.endpoints[conn.index].0, "dropping etcd connection");
        }
    }

    /// Runs one unary call with the request timeout; on an endpoint failure
    /// drops the connection, and for an idempotent call tries the other
    /// endpoints once each.
    pub(crate) async fn unary<T, F, Fut>(
        &self,
        op: &'static str,
        idempotent: bool,
        call: F,
    ) -> Result<T, Error>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let attempts = if idempotent {
            self.inner.endpoints.len()
        } else {
            1
        };
        let timeout = self.inner.options.request_timeout;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let conn = self.connected().await?;
            let error = match tokio::time::timeout(timeout, call(conn.channel.clone())).await {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => Error::status(op, status),
                Err(_) => Error::Timeout { op, timeout },
            };
            if error.is_endpoint_failure() {
                self.connection_failed(&conn).await;
                if attempt < attempts {
                    continue;
                }
            }
            return Err(error);
        }
    }

    fn kv(channel: Channel) -> KvClient<Channel> {
        KvClient::new(channel).max_decoding_message_size(DECODED_MESSAGE_BYTES_MAX)
    }

    /// Reads one key.
    pub async fn get(&self, key: impl Into<Vec<u8>>) -> Result<GetResponse, Error> {
        let key = non_empty_key(key.into())?;
        let request = rpc::RangeRequest {
            key,
            ..Default::default()
        };
        let response = self
            .unary("range", true, |ch| {
                let request = request.clone();
                async move { Self::kv(ch).range(request).await }
            })
            .await?;
        let revision = header_revision("range", response.header.as_ref())?;
        Ok(GetResponse {
            kv: response.kvs.into_iter().next(),
            revision,
        })
    }

    /// Reads every key that starts with `prefix` (every key, for an empty
    /// prefix), in key order, in pages of `range_page_keys_max` keys all
    /// read at the revision of the first page, so the result is one
    /// consistent snapshot however many pages it takes.
    pub async fn range_prefix(&self, prefix: impl Into<Vec<u8>>) -> Result<RangeResponse, Error> {
        let (key, range_end) = prefix_range(prefix.into());
        self.range(key, range_end).await
    }

    /// Reads the keys in `[key, range_end)`, paged as [`Client::range_prefix`].
    /// A `range_end` of `[0]` means every key from `key` on.
    pub async fn range(&self, key: Vec<u8>, range_end: Vec<u8>) -> Result<RangeResponse, Error> {
        let key = non_empty_key(key)?;
        let page = self.inner.options.range_page_keys_max.max(1);
        let mut kvs = Vec::new();
        let mut revision = 0;
        let mut next_key = key;
        loop {
            let request = rpc::RangeRequest {
                key: next_key.clone(),
                range_end: range_end.clone(),
                limit: page,
                revision,
                ..Default::default()
            };
            let response = self
                .unary("range", true, |ch| {
                    let request = request.clone();
                    async move { Self::kv(ch).range(request).await }
                })
                .await?;
            let page_revision = header_revision("range", response.header.as_ref())?;
            if revision == 0 {
                revision = page_revision;
            }
            let more = response.more;
            if let Some(last) = response.kvs.last() {
                next_key = last.key.clone();
                next_key.push(0);
            } else if more {
                return Err(Error::Malformed {
                    op: "range",
                    what: "an empty page says more keys follow",
                });
            }
            kvs.extend(response.kvs);
            if !more {
                return Ok(RangeResponse { kvs, revision });
            }
        }
    }

    /// Writes `value` at `key`, attached to `lease` if given (the key is
    /// deleted when the lease ends).
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: Option<crate::LeaseId>,
    ) -> Result<PutResponse, Error> {
        let request = rpc::PutRequest {
            key: non_empty_key(key.into())?,
            value: value.into(),
            lease: lease.map_or(0, |l| l.0),
            ..Default::default()
        };
        let response = self
            .unary("put", false, |ch| {
                let request = request.clone();
                async move { Self::kv(ch).put(request).await }
            })
            .await?;
        Ok(PutResponse {
            revision: header_revision("put", response.header.as_ref())?,
        })
    }

    /// Deletes one key.
    pub async fn delete(&self, key: impl Into<Vec<u8>>) -> Result<DeleteResponse, Error> {
        let key = non_empty_key(key.into())?;
        self.delete_range(key, Vec::new()).await
    }

    /// Deletes every key that starts with `prefix`. An empty prefix is
    /// refused: deleting the whole store is never what a caller meant.
    pub async fn delete_prefix(&self, prefix: impl Into<Vec<u8>>) -> Result<DeleteResponse, Error> {
        let prefix = prefix.into();
        if prefix.is_empty() {
            return Err(Error::InvalidArgument {
                what: "delete_prefix of an empty prefix would delete every key",
            });
        }
        let (key, range_end) = prefix_range(prefix);
        self.delete_range(key, range_end).await
    }

    async fn delete_range(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
    ) -> Result<DeleteResponse, Error> {
        let request = rpc::DeleteRangeRequest {
            key,
            range_end,
            prev_kv: false,
        };
        let response = self
            .unary("delete", false, |ch| {
                let request = request.clone();
                async move { Self::kv(ch).delete_range(request).await }
            })
            .await?;
        Ok(DeleteResponse {
            deleted: response.deleted,
            revision: header_revision("delete", response.header.as_ref())?,
        })
    }

    /// Runs a transaction: if every comparison holds, its `and_then` ops,
    /// else its `or_else` ops, atomically at one new revision. etcd refuses
    /// more than `--max-txn-ops` (default 128) ops in one branch, and two
    /// writes to one key in one transaction.
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse, Error> {
        let request = txn.into_request();
        let response = self
            .unary("txn", false, |ch| {
                let request = request.clone();
                async move { Self::kv(ch).txn(request).await }
            })
            .await?;
        TxnResponse::from_pb(response)
    }

    /// Compacts etcd's history up to `revision`: watches and reads from
    /// older revisions fail with [`Error::Compacted`] afterwards.
    pub async fn compact(&self, revision: i64) -> Result<(), Error> {
        let request = rpc::CompactionRequest {
            revision,
            physical: true,
        };
        self.unary("compact", false, |ch| async move {
            Self::kv(ch).compact(request).await
        })
        .await?;
        Ok(())
    }
}

fn make_endpoint(endpoint: &str, options: &ClientOptions) -> Result<Endpoint, Error> {
    let invalid = || Error::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
    };
    // Only plain http: the tests and the Debian package serve it, and TLS
    // would need certificates rotary has no way to configure yet.
    let rest = endpoint.strip_prefix("http://").ok_or_else(invalid)?;
    if rest.is_empty() || rest.contains('/') && !rest.ends_with('/') {
        return Err(invalid());
    }
    Ok(Endpoint::from_shared(endpoint.to_owned())
        .map_err(|_| invalid())?
        .connect_timeout(options.connect_timeout)
        .http2_keep_alive_interval(options.keep_alive_interval)
        .keep_alive_timeout(options.keep_alive_timeout)
        // etcd's default enforcement policy refuses pings on a connection
        // without streams (and closes it for "too many pings").
        .keep_alive_while_idle(false)
        .tcp_nodelay(true))
}

pub(crate) fn non_empty_key(key: Vec<u8>) -> Result<Vec<u8>, Error> {
    if key.is_empty() {
        return Err(Error::InvalidArgument {
            what: "empty key (etcd has no empty key; use a prefix range for all keys)",
        });
    }
    Ok(key)
}

pub(crate) fn header_revision(
    op: &'static str,
    header: Option<&rpc::ResponseHeader>,
) -> Result<i64, Error> {
    header.map(|h| h.revision).ok_or(Error::Malformed {
        op,
        what: "no response header",
    })
}

/// The `[key, range_end)` etcd uses for "every key starting with `prefix`":
/// `range_end` is `prefix` with its last byte below 0xff incremented and
/// what follows dropped. An empty prefix, or one of only 0xff bytes, has no
/// such end; `[0]` then means "no upper bound".
pub fn prefix_range(prefix: Vec<u8>) -> (Vec<u8>, Vec<u8>) {
    if prefix.is_empty() {
        return (vec![0], vec![0]);
    }
    let mut end = prefix.clone();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return (prefix, end);
        }
    }
    (prefix, vec![0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_range_is_the_next_prefix() {
        assert_eq!(
            prefix_range(b"/rotary/items/".to_vec()),
            (b"/rotary/items/".to_vec(), b"/rotary/items0".to_vec())
        );
        assert_eq!(
            prefix_range(vec![b'a', 0xff]),
            (vec![b'a', 0xff], vec![b'b'])
        );
        assert_eq!(prefix_range(vec![0xff, 0xff]), (vec![0xff, 0xff], vec![0]));
        assert_eq!(prefix_range(Vec::new()), (vec![0], vec![0]));
    }

    #[test]
    fn endpoints_must_be_plain_http_urls() {
        let options = ClientOptions::default();
        assert!(make_endpoint("http://127.0.0.1:2379", &options).is_ok());
        assert!(make_endpoint("http://127.0.0.1:2379/", &options).is_ok());
        for bad in [
            "127.0.0.1:2379",
            "https://127.0.0.1:2379",
            "http://",
            "http://a:1/b",
        ] {
            match make_endpoint(bad, &options) {
                Err(Error::InvalidEndpoint { endpoint }) => assert_eq!(endpoint, bad),
                other => panic!("{bad}: {:?}", other.map(|_| ())),
            }
        }
    }

    #[test]
    fn empty_keys_are_refused_before_sending() {
        assert!(matches!(
            non_empty_key(Vec::new()),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(non_empty_key(b"k".to_vec()).unwrap(), b"k".to_vec());
    }
}
