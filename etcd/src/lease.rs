//! Leases: grant, revoke, one-shot keep-alive, and a task that keeps one alive.
#![allow(clippy::disallowed_methods)] // Leases and keepalives run on real time, against a real etcd.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::client::Client;
use crate::error::Error;
use crate::pb::etcdserverpb as rpc;
use crate::pb::etcdserverpb::lease_client::LeaseClient;

/// An etcd lease ID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A granted lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its ID.
    pub id: LeaseId,
    /// The time-to-live etcd granted (it may round a request up).
    pub ttl: Duration,
    /// When the grant was sent: etcd cannot expire the lease before
    /// `granted_at + ttl`.
    pub granted_at: Instant,
}

/// Where a [`LeaseKeeper`]'s lease stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Renewed; etcd cannot expire it before this instant.
    Alive {
        /// Lower bound on the lease's expiry, measured from when the last
        /// successful renewal was *sent*.
        valid_until: Instant,
    },
    /// etcd said the lease does not exist (expired or revoked).
    NotFound,
    /// No renewal succeeded before `valid_until` passed: the lease may
    /// have expired.
    Expired,
}

fn ttl_from_secs(op: &'static str, secs: i64) -> Result<Duration, Error> {
    u64::try_from(secs)
        .map(Duration::from_secs)
        .map_err(|_| Error::Malformed {
            op,
            what: "negative TTL",
        })
}

impl Client {
    fn lease_client(channel: tonic::transport::Channel) -> LeaseClient<tonic::transport::Channel> {
        LeaseClient::new(channel)
            .max_decoding_message_size(crate::client::DECODED_MESSAGE_BYTES_MAX)
    }

    /// Grants a lease of `ttl`, rounded up to whole seconds (etcd's unit).
    /// etcd raises a TTL below its minimum (about 1.5 × its election
    /// timeout, 2 s by default) to that minimum.
    pub async fn lease_grant(&self, ttl: Duration) -> Result<Lease, Error> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        if secs == 0 {
            return Err(Error::InvalidArgument {
                what: "lease TTL must be at least one second",
            });
        }
        let request = rpc::LeaseGrantRequest {
            ttl: i64::try_from(secs).map_err(|_| Error::InvalidArgument {
                what: "lease TTL is too long",
            })?,
            id: 0,
        };
        let granted_at = Instant::now();
        let response = self
            .unary("lease grant", false, |ch| async move {
                Self::lease_client(ch).lease_grant(request).await
            })
            .await?;
        if response.id == 0 {
            return Err(Error::Malformed {
                op: "lease grant",
                what: "lease ID 0",
            });
        }
        Ok(Lease {
            id: LeaseId(response.id),
            ttl: ttl_from_secs("lease grant", response.ttl)?,
            granted_at,
        })
    }

    /// Revokes a lease: etcd deletes every key attached to it.
    pub async fn lease_revoke(&self, id: LeaseId) -> Result<(), Error> {
        let request = rpc::LeaseRevokeRequest { id: id.0 };
        match self
            .unary("lease revoke", false, |ch| async move {
                Self::lease_client(ch).lease_revoke(request).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Status { status, .. }) if status.code() == tonic::Code::NotFound => {
                Err(Error::LeaseNotFound { lease_id: id.0 })
            }
            Err(e) => Err(e),
        }
    }

    /// The lease's remaining time-to-live, or `None` if it does not exist.
    pub async fn lease_time_to_live(&self, id: LeaseId) -> Result<Option<Duration>, Error> {
        let request = rpc::LeaseTimeToLiveRequest {
            id: id.0,
            keys: false,
        };
        let response = self
            .unary("lease time-to-live", true, |ch| async move {
                Self::lease_client(ch).lease_time_to_live(request).await
            })
            .await?;
        if response.ttl < 0 {
            return Ok(None);
        }
        Ok(Some(ttl_from_secs("lease time-to-live", response.ttl)?))
    }

    /// Renews a lease once, returning its new time-to-live.
    /// [`Error::LeaseNotFound`] when it has expired or was revoked.
    pub async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Duration, Error> {
        let conn = self.connected().await?;
        let timeout = self.options().request_timeout;
        let result = tokio::time::timeout(timeout, keep_alive_once(conn.channel.clone(), id)).await;
        let error = match result {
            Ok(Ok(ttl)) => return Ok(ttl),
            Ok(Err(e)) => e,
            Err(_) => Error::Timeout {
                op: "lease keep-alive",
                timeout,
            },
        };
        if error.is_endpoint_failure() {
            self.connection_failed(&conn).await;
        }
        Err(error)
    }

    /// Starts a task (on the current tokio runtime) that keeps `lease`
    /// alive until the returned keeper is dropped or the lease is lost.
    ///
    /// It renews every third of the TTL over one keep-alive stream,
    /// reopening the stream (on the next endpoint) when it breaks. The lease
    /// is lost when etcd says it is gone, or when no renewal succeeded
    /// before the last known `valid_until`: the keeper then reports
    /// [`LeaseState::NotFound`] or [`LeaseState::Expired`] and stops.
    pub fn keep_lease_alive(&self, lease: Lease) -> LeaseKeeper {
        let (state_tx, state_rx) = watch::channel(LeaseState::Alive {
            valid_until: lease.granted_at + lease.ttl,
        });
        let task = tokio::spawn(keep_alive_task(self.clone(), lease, state_tx));
        LeaseKeeper {
            id: lease.id,
            state: state_rx,
            task,
        }
    }
}

async fn keep_alive_once(
    channel: tonic::transport::Channel,
    id: LeaseId,
) -> Result<Duration, Error> {
    let op = "lease keep-alive";
    let (tx, rx) = mpsc::channel(1);
    tx.send(rpc::LeaseKeepAliveRequest { id: id.0 })
        .await
        .expect("the receiver is alive");
    let mut stream = Client::lease_client(channel)
        .lease_keep_alive(ReceiverStream::new(rx))
        .await
        .map_err(|s| Error::status(op, s))?
        .into_inner();
    match stream.message().await {
        Ok(Some(response)) if response.ttl <= 0 => Err(Error::LeaseNotFound { lease_id: id.0 }),
        Ok(Some(response)) => ttl_from_secs(op, response.ttl),
        Ok(None) => Err(Error::StreamClosed { op }),
        Err(status) => Err(Error::status(op, status)),
    }
}

/// Keeps a lease alive from a background task; see [`Client::keep_lease_alive`].
///
/// Dropping it stops the renewals (the lease then expires after its TTL);
/// [`LeaseKeeper::revoke`] ends it at once.
pub struct LeaseKeeper {
    id: LeaseId,
    state: watch::Receiver<LeaseState>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for LeaseKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeeper")
            .field("id", &self.id)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl LeaseKeeper {
    /// The lease.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The lease's state now.
    pub fn state(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// Until when the lease is certainly alive, or `None` once it is lost.
    /// A holder that must stop acting before etcd can expire the lease
    /// (a primary broker) stops at `valid_until` minus its own margin for
    /// clock drift and scheduling delay.
    pub fn valid_until(&self) -> Option<Instant> {
        match self.state() {
            LeaseState::Alive { valid_until } => Some(valid_until),
            LeaseState::NotFound | LeaseState::Expired => None,
        }
    }

    /// A receiver that sees every change of state (for `select!`).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// Waits until the lease is lost and says how:
    /// [`Error::LeaseNotFound`] or [`Error::LeaseExpired`].
    pub async fn lost(&mut self) -> Error {
        let lease_id = self.id.0;
        let state = self
            .state
            .wait_for(|s| !matches!(s, LeaseState::Alive { .. }))
            .await
            .map(|s| *s)
            // The task ended without saying (it panicked): treat as expired.
            .unwrap_or(LeaseState::Expired);
        match state {
            LeaseState::NotFound => Error::LeaseNotFound { lease_id },
            _ => Error::LeaseExpired { lease_id },
        }
    }

    /// Stops renewing and revokes the lease, deleting its keys.
    pub async fn revoke(self, client: &Client) -> Result<(), Error> {
        self.task.abort();
        client.lease_revoke(self.id).await
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Delay between attempts to reopen a broken keep-alive stream.
const REOPEN_DELAY: Duration = Duration::from_millis(200);

async fn keep_alive_task(client: Client, lease: Lease, state: watch::Sender<LeaseState>) {
    let id = lease.id;
    let interval = (lease.ttl / 3).max(Duration::from_millis(500));
    let mut valid_until = lease.granted_at + lease.ttl;
    loop {
        // Open a stream, or wait and try again while the lease may still live.
        let now = Instant::now();
        if now >= valid_until {
            tracing::warn!(lease = %id, "etcd lease could not be renewed before it could expire");
            let _ = state.send(LeaseState::Expired);
            return;
        }
        let conn = match client.connected().await {
            Ok(conn) => conn,
            Err(error) => {
                tracing::debug!(lease = %id, %error, "cannot reach etcd to renew the lease");
                tokio::time::sleep_until((now + REOPEN_DELAY).min(valid_until)).await;
                continue;
            }
        };
        let (tx, rx) = mpsc::channel(1);
        let mut sent_at = Instant::now();
        if tx
            .send(rpc::LeaseKeepAliveRequest { id: id.0 })
            .await
            .is_err()
        {
            unreachable!("the receiver is alive");
        }
        let opened = tokio::time::timeout_at(
            valid_until,
            Client::lease_client(conn.channel.clone()).lease_keep_alive(ReceiverStream::new(rx)),
        )
        .await;
        let mut stream = match opened {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => {
                tracing::debug!(lease = %id, %status, "lease keep-alive stream failed");
                client.connection_failed(&conn).await;
                tokio::time::sleep_until((Instant::now() + REOPEN_DELAY).min(valid_until)).await;
                continue;
            }
            Err(_) => continue, // valid_until passed: reported at the top.
        };
        // Renew every `interval` on this stream until it breaks.
        loop {
            let deadline = (sent_at + client.options().request_timeout).min(valid_until);
            match tokio::time::timeout_at(deadline, stream.message()).await {
                Ok(Ok(Some(response))) => {
                    if response.ttl <= 0 {
                        tracing::warn!(lease = %id, "etcd says the lease is gone");
                        let _ = state.send(LeaseState::NotFound);
                        return;
                    }
                    let ttl = Duration::from_secs(response.ttl.unsigned_abs());
                    valid_until = valid_until.max(sent_at + ttl);
                    let _ = state.send(LeaseState::Alive { valid_until });
                }
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                    client.connection_failed(&conn).await;
                    break;
                }
            }
            tokio::time::sleep(interval).await;
            if state.is_closed() {
                return; // Nobody holds the keeper any more.
            }
            sent_at = Instant::now();
            if tx
                .send(rpc::LeaseKeepAliveRequest { id: id.0 })
                .await
                .is_err()
            {
                break;
            }
        }
    }
}
