//! Watching a prefix: batches of events in revision order, resumed across
//! broken streams without losing or repeating an event.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::client::{non_empty_key, prefix_range, Client, Connected};
use crate::error::Error;
use crate::pb::etcdserverpb as rpc;
use crate::pb::etcdserverpb::watch_client::WatchClient;
use crate::pb::mvccpb::{self, KeyValue};

/// How to watch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchOptions {
    /// First revision to deliver (inclusive). 0 means "from now"; after a
    /// read at revision R, watch from R + 1 to miss nothing.
    pub start_revision: i64,
    /// Deliver each event's previous key-value (`Event::prev_kv`).
    pub prev_kv: bool,
    /// Ask etcd for empty batches while nothing changes, which move
    /// `Watcher::next_revision` forward.
    pub progress_notify: bool,
}

/// What happened to a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Created or modified.
    Put,
    /// Deleted (also by a lease's end).
    Delete,
}

/// One change.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after a put; for a delete, the key with `mod_revision` set to
    /// the deletion's revision and no value.
    pub kv: KeyValue,
    /// The key before the change, when the watch asked for it (and etcd
    /// still had it).
    pub prev_kv: Option<KeyValue>,
}

/// Events of whole revisions, in revision order.
#[derive(Clone, Debug, PartialEq)]
pub struct WatchBatch {
    /// The revision through which the watcher has now delivered every
    /// event: the last event's revision, or for an empty (progress) batch
    /// the revision etcd reported.
    pub revision: i64,
    /// The store's revision when etcd sent the batch (may be ahead of
    /// `revision` while the watcher catches up on history).
    pub header_revision: i64,
    /// The events; empty for a progress notification.
    pub events: Vec<Event>,
}

/// Delays between attempts to reopen a broken watch: the first retry is
/// immediate, later ones back off up to the maximum.
const REOPEN_DELAY_MIN: Duration = Duration::from_millis(100);
const REOPEN_DELAY_MAX: Duration = Duration::from_secs(2);

/// A watch on a key or prefix. Get batches with [`Watcher::next`].
///
/// A retryable error from `next` means the stream broke (etcd restarted,
/// the connection dropped): the next call reopens it, on the next endpoint
/// and after a short backoff, from [`Watcher::next_revision`], so no event
/// is lost or delivered twice. A non-retryable error ([`Error::Compacted`],
/// [`Error::WatchCanceled`]) ends the watch: every later call returns it
/// again; read the state afresh and start a new watch.
pub struct Watcher {
    client: Client,
    key: Vec<u8>,
    range_end: Vec<u8>,
    options: WatchOptions,
    next_revision: i64,
    stream: Option<Open>,
    failures: u32,
    ended: Option<Ended>,
}

struct Open {
    // Kept so the request stream stays open (dropping it half-closes the
    // call, and etcd then ends the watch).
    _requests: mpsc::Sender<rpc::WatchRequest>,
    responses: tonic::Streaming<rpc::WatchResponse>,
    conn: Connected,
}

#[derive(Clone, Debug)]
enum Ended {
    Compacted {
        start_revision: i64,
        compact_revision: i64,
    },
    Canceled {
        reason: String,
    },
}

impl Client {
    /// Watches every key that starts with `prefix`. Opens the stream before
    /// returning, so an unreachable etcd is an error here.
    pub async fn watch_prefix(
        &self,
        prefix: impl Into<Vec<u8>>,
        options: WatchOptions,
    ) -> Result<Watcher, Error> {
        let (key, range_end) = prefix_range(prefix.into());
        self.watch_range(key, range_end, options).await
    }

    /// Watches one key.
    pub async fn watch_key(
        &self,
        key: impl Into<Vec<u8>>,
        options: WatchOptions,
    ) -> Result<Watcher, Error> {
        let key = non_empty_key(key.into())?;
        self.watch_range(key, Vec::new(), options).await
    }

    async fn watch_range(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        options: WatchOptions,
    ) -> Result<Watcher, Error> {
        if options.start_revision < 0 {
            return Err(Error::InvalidArgument {
                what: "watch start revision is negative",
            });
        }
        let mut watcher = Watcher {
            client: self.clone(),
            key,
            range_end,
            options,
            next_revision: options.start_revision,
            stream: None,
            failures: 0,
            ended: None,
        };
        watcher.open().await?;
        Ok(watcher)
    }
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("key", &String::from_utf8_lossy(&self.key))
            .field("next_revision", &self.next_revision)
            .field("open", &self.stream.is_some())
            .finish_non_exhaustive()
    }
}

impl Watcher {
    /// The first revision not yet delivered: where a resumed stream starts.
    pub fn next_revision(&self) -> i64 {
        self.next_revision
    }

    /// The next batch of events (or progress notification).
    pub async fn next(&mut self) -> Result<WatchBatch, Error> {
        loop {
            if let Some(ended) = &self.ended {
                return Err(self.ended_error(ended.clone()));
            }
            if self.stream.is_none() {
                if self.failures > 0 {
                    let shift = (self.failures - 1).min(5);
                    tokio::time::sleep((REOPEN_DELAY_MIN * (1 << shift)).min(REOPEN_DELAY_MAX))
                        .await;
                }
                self.open().await?;
            }
            let open = self.stream.as_mut().expect("opened above");
            let error = match open.responses.message().await {
                Ok(Some(response)) => match self.accept(response)? {
                    Some(batch) => {
                        self.failures = 0;
                        return Ok(batch);
                    }
                    None => continue,
                },
                Ok(None) => Error::StreamClosed { op: "watch" },
                Err(status) => Error::status("watch", status),
            };
            self.broken().await;
            return Err(error);
        }
    }

    async fn broken(&mut self) {
        self.failures = self.failures.saturating_add(1);
        if let Some(open) = self.stream.take() {
            self.client.connection_failed(&open.conn).await;
        }
    }

    fn ended_error(&self, ended: Ended) -> Error {
        match ended {
            Ended::Compacted {
                start_revision,
                compact_revision,
            } => Error::Compacted {
                start_revision,
                compact_revision,
            },
            Ended::Canceled { reason } => Error::WatchCanceled {
                key: String::from_utf8_lossy(&self.key).into_owned(),
                reason,
            },
        }
    }

    /// Opens a stream from `next_revision` and waits for etcd to confirm it.
    async fn open(&mut self) -> Result<(), Error> {
        let conn = match self.client.connected().await {
            Ok(conn) => conn,
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::channel(1);
        let create = rpc::WatchRequest {
            request_union: Some(rpc::watch_request::RequestUnion::CreateRequest(
                rpc::WatchCreateRequest {
                    key: self.key.clone(),
                    range_end: self.range_end.clone(),
                    start_revision: self.next_revision,
                    progress_notify: self.options.progress_notify,
                    filters: Vec::new(),
                    prev_kv: self.options.prev_kv,
                    watch_id: 0,
                    fragment: false,
                },
            )),
        };
        tx.send(create).await.expect("the receiver is alive");
        let timeout = self.client.options().request_timeout;
        let mut client = WatchClient::new(conn.channel.clone())
            .max_decoding_message_size(crate::client::DECODED_MESSAGE_BYTES_MAX);
        let error = match tokio::time::timeout(timeout, client.watch(ReceiverStream::new(rx))).await
        {
            Ok(Ok(response)) => {
                self.stream = Some(Open {
                    _requests: tx,
                    responses: response.into_inner(),
                    conn,
                });
                // Wait for `created` (or a compaction / cancel answer).
                let open = self.stream.as_mut().expect("just set");
                match tokio::time::timeout(timeout, open.responses.message()).await {
                    Ok(Ok(Some(response))) => {
                        if self.accept_created(response)? {
                            return Ok(());
                        }
                        Error::Malformed {
                            op: "watch",
                            what: "the first response does not confirm the watch",
                        }
                    }
                    Ok(Ok(None)) => Error::StreamClosed { op: "watch" },
                    Ok(Err(status)) => Error::status("watch", status),
                    Err(_) => Error::Timeout {
                        op: "watch",
                        timeout,
                    },
                }
            }
            Ok(Err(status)) => {
                self.failures = self.failures.saturating_add(1);
                self.client.connection_failed(&conn).await;
                return Err(Error::status("watch", status));
            }
            Err(_) => {
                self.failures = self.failures.saturating_add(1);
                self.client.connection_failed(&conn).await;
                return Err(Error::Timeout {
                    op: "watch",
                    timeout,
                });
            }
        };
        self.broken().await;
        Err(error)
    }

    /// Handles the first response of a stream. `Ok(true)` once created.
    fn accept_created(&mut self, response: rpc::WatchResponse) -> Result<bool, Error> {
        self.check_ended(&response)?;
        if !response.created {
            return Ok(false);
        }
        if self.next_revision == 0 {
            // "From now": everything after the revision the watch was created at.
            let header = crate::client::header_revision("watch", response.header.as_ref())?;
            self.next_revision = header + 1;
        }
        Ok(true)
    }

    fn check_ended(&mut self, response: &rpc::WatchResponse) -> Result<(), Error> {
        let ended = if response.compact_revision != 0 {
            Ended::Compacted {
                start_revision: self.next_revision,
                compact_revision: response.compact_revision,
            }
        } else if response.canceled {
            Ended::Canceled {
                reason: response.cancel_reason.clone(),
            }
        } else {
            return Ok(());
        };
        self.stream = None;
        self.ended = Some(ended.clone());
        Err(self.ended_error(ended))
    }

    /// Turns a response into a batch, or `None` for one to skip.
    fn accept(&mut self, response: rpc::WatchResponse) -> Result<Option<WatchBatch>, Error> {
        self.check_ended(&response)?;
        if response.created {
            return Ok(None);
        }
        let header_revision = crate::client::header_revision("watch", response.header.as_ref())?;
        let mut events = Vec::with_capacity(response.events.len());
        for event in response.events {
            let kind = match mvccpb::event::EventType::try_from(event.r#type) {
                Ok(mvccpb::event::EventType::Put) => EventKind::Put,
                Ok(mvccpb::event::EventType::Delete) => EventKind::Delete,
                Err(_) => {
                    return Err(Error::Malformed {
                        op: "watch",
                        what: "an event of unknown type",
                    })
                }
            };
            let kv = event.kv.ok_or(Error::Malformed {
                op: "watch",
                what: "an event without a key",
            })?;
            if kv.mod_revision < self.next_revision {
                return Err(Error::Malformed {
                    op: "watch",
                    what: "an event older than the revision the watch started from",
                });
            }
            events.push(Event {
                kind,
                kv,
                prev_kv: event.prev_kv,
            });
        }
        let revision = match events.last() {
            Some(last) => last.kv.mod_revision,
            None => {
                if header_revision < self.next_revision {
                    // A progress report from before our start: nothing new.
                    return Ok(None);
                }
                header_revision
            }
        };
        self.next_revision = revision + 1;
        Ok(Some(WatchBatch {
            revision,
            header_revision,
            events,
        }))
    }
}
