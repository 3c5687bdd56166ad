//! The publisher: frames messages, gives each its UUID in the order its
//! journal receives it, and appends them, retrying unknown outcomes.
//!
//! Each journal written gets a task that appends its messages one append
//! at a time. Messages are framed into the journal's buffer as they are
//! published, with the clock ticked at that moment, so the journal's bytes
//! are in clock order however many journals are written at once; a buffer
//! goes to its task once it holds [`PublisherOptions::append_bytes_max`]
//! bytes, and at every flush, commit or rollback. A failed append is sent
//! again, the same bytes under the same UUIDs, until it succeeds or
//! [`PublisherOptions::retry_for`] has passed: a copy that did commit is a
//! duplicate that read-committed readers drop. Only one append per journal
//! is in flight, so a retry never lands behind a later message.

use super::framing::{Framing, CONTENT_TYPE_LABEL, UUID_POINTER_DEFAULT};
use super::uuid::{Clock, Flags, ProducerId, Uuid};
use super::MessageError;
use crate::client::{Client, ClientError};
use crate::status::Status;
use crate::wire::AppendRequest;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Buffers handed to a journal's task and not yet appended, per journal;
/// publishing waits when they are all taken.
pub const QUEUED_APPENDS_MAX: usize = 8;
/// First pause before a retry; it doubles up to [`RETRY_PAUSE_MAX`].
pub const RETRY_PAUSE_MIN: Duration = Duration::from_millis(50);
pub const RETRY_PAUSE_MAX: Duration = Duration::from_secs(1);

/// How a [`Publisher`] behaves.
#[derive(Clone, Debug)]
pub struct PublisherOptions {
    /// How long an append whose outcome is unknown, or that was refused
    /// with a retryable status, is tried again before the publisher gives
    /// up on it. It should cover a broker's restart.
    pub retry_for: Duration,
    /// A journal's buffered messages are appended once they reach this
    /// many bytes (a single larger message is appended alone).
    pub append_bytes_max: usize,
    /// Where JSON-lines messages hold their UUID.
    pub uuid_pointer: String,
    /// Framing of journals without a `content-type` label; `None` refuses them.
    pub default_framing: Option<Framing>,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        PublisherOptions {
            retry_for: Duration::from_secs(120),
            append_bytes_max: 256 << 10,
            uuid_pointer: UUID_POINTER_DEFAULT.to_string(),
            default_framing: None,
        }
    }
}

/// Counters of a publisher's appends.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Appends that committed.
    pub appends: AtomicU64,
    /// Appends sent again after a failure whose outcome was unknown (the
    /// first copy may have committed: a duplicate in the journal).
    pub retries_unknown: AtomicU64,
    /// Appends sent again after a refusal (nothing of them committed).
    pub retries_refused: AtomicU64,
}

enum Cmd {
    Append(Bytes),
    /// Answered once every append queued before it is done.
    Barrier(oneshot::Sender<Result<(), MessageError>>),
    /// Forgets an earlier failure (a rollback follows).
    Reset,
}

struct JournalState {
    framing: Framing,
    buf: Vec<u8>,
    tx: mpsc::Sender<Cmd>,
    /// The producer's last committed clock in this journal, as its readers
    /// know it: the clock a rollback acknowledges.
    committed: Option<Clock>,
    /// Bytes of the last buffer handed to the task (at most
    /// `append_bytes_max`): the next buffer is reserved at that size when
    /// its first message is framed, rather than regrown from empty, which
    /// copies each buffer about twice over.
    chunk_len_last: usize,
}

impl JournalState {
    /// The buffered messages, to append.
    fn take_chunk(&mut self, append_bytes_max: usize) -> Bytes {
        let chunk = std::mem::take(&mut self.buf);
        self.chunk_len_last = chunk.len().min(append_bytes_max);
        chunk.into()
    }
}

/// Publishes messages to journals (see the module documentation). Not
/// shared between tasks: each publisher is one producer with one clock.
pub struct Publisher {
    client: Client,
    producer: ProducerId,
    clock: Clock,
    now: fn() -> Clock,
    options: PublisherOptions,
    journals: BTreeMap<String, JournalState>,
    /// Journals the open transaction touched.
    txn: BTreeSet<String>,
    stats: Arc<PublisherStats>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("producer", &self.producer)
            .field("clock", &self.clock)
            .field("txn", &self.txn)
            .finish()
    }
}

impl Publisher {
    /// A publisher with a new random producer id.
    pub fn new(client: Client, options: PublisherOptions) -> Publisher {
        Publisher::resume(client, ProducerId::random(), Clock(0), options)
    }

    /// A publisher continuing `producer`, whose last clock was `last_clock`:
    /// its clock starts beyond it even if the wall clock went back.
    pub fn resume(
        client: Client,
        producer: ProducerId,
        last_clock: Clock,
        options: PublisherOptions,
    ) -> Publisher {
        Publisher {
            client,
            producer,
            clock: last_clock,
            now: Clock::wall,
            options,
            journals: BTreeMap::new(),
            txn: BTreeSet::new(),
            stats: Arc::new(PublisherStats::default()),
        }
    }

    pub fn producer(&self) -> ProducerId {
        self.producer
    }

    /// The last clock given out (to persist for [`Publisher::resume`]).
    pub fn clock(&self) -> Clock {
        self.clock
    }

    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }

    /// Uses `framing` for `journal` instead of asking the broker for its
    /// labels (before its first message).
    pub fn set_framing(&mut self, journal: &str, framing: Framing) {
        self.journal_with(journal, framing);
    }

    fn tick(&mut self) -> Clock {
        self.clock.update((self.now)());
        self.clock.tick()
    }

    fn journal_with(&mut self, journal: &str, framing: Framing) -> &mut JournalState {
        if !self.journals.contains_key(journal) {
            let (tx, rx) = mpsc::channel(QUEUED_APPENDS_MAX);
            tokio::spawn(append_loop(
                self.client.clone(),
                journal.to_string(),
                rx,
                self.options.retry_for,
                self.stats.clone(),
            ));
            self.journals.insert(
                journal.to_string(),
                JournalState {
                    framing,
                    buf: Vec::new(),
                    tx,
                    committed: None,
                    chunk_len_last: 0,
                },
            );
        }
        self.journals.get_mut(journal).expect("inserted")
    }

    async fn framing_of(&self, journal: &str) -> Result<Framing, MessageError> {
        let deadline = tokio::time::Instant::now() + self.options.retry_for;
        let mut pause = RETRY_PAUSE_MIN;
        let listed = loop {
            match self.client.list("").await {
                Ok(l) => break l,
                Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                Err(e) => return Err(e.into()),
            }
        };
        let info = listed
            .into_iter()
            .find(|j| j.spec.name == journal)
            .ok_or_else(|| MessageError::JournalNotFound {
                journal: journal.to_string(),
            })?;
        let ct = info.spec.labels.values_of(CONTENT_TYPE_LABEL).next();
        match (ct, &self.options.default_framing) {
            (None, Some(f)) => Ok(f.clone()),
            (ct, _) => Framing::from_content_type(journal, ct, &self.options.uuid_pointer),
        }
    }

    /// Looks up `journal`'s framing now rather than at its first message,
    /// so that a missing journal or label is found before anything is
    /// published.
    pub async fn prepare(&mut self, journal: &str) -> Result<(), MessageError> {
        self.ensure(journal).await
    }

    async fn ensure(&mut self, journal: &str) -> Result<(), MessageError> {
        if !self.journals.contains_key(journal) {
            let framing = self.framing_of(journal).await?;
            self.journal_with(journal, framing);
        }
        Ok(())
    }

    /// Publishes a message outside any transaction: readers deliver it as
    /// soon as they read it. It is appended at the next flush, or once the
    /// journal's buffer is full.
    pub async fn publish_committed(
        &mut self,
        journal: &str,
        payload: &[u8],
    ) -> Result<Uuid, MessageError> {
        if self.txn.contains(journal) {
            return Err(MessageError::MixedTransaction {
                journal: journal.to_string(),
            });
        }
        self.publish(journal, payload, Flags::OUTSIDE_TXN).await
    }

    /// Publishes a message of the open transaction (one begins with the
    /// first such message): readers deliver it once [`Publisher::commit`]
    /// acknowledged it.
    pub async fn publish_uncommitted(
        &mut self,
        journal: &str,
        payload: &[u8],
    ) -> Result<Uuid, MessageError> {
        self.publish(journal, payload, Flags::CONTINUE_TXN).await
    }

    async fn publish(
        &mut self,
        journal: &str,
        payload: &[u8],
        flags: Flags,
    ) -> Result<Uuid, MessageError> {
        self.ensure(journal).await?;
        let clock = self.tick();
        let uuid = Uuid::build(self.producer, clock, flags);
        let limit = self.options.append_bytes_max;
        let state = self.journals.get_mut(journal).expect("ensured");
        if state.buf.is_empty() {
            state.buf.reserve(state.chunk_len_last);
        }
        let len = state.buf.len();
        if let Err(e) = state.framing.encode(uuid, payload, &mut state.buf) {
            state.buf.truncate(len);
            return Err(e);
        }
        if flags == Flags::OUTSIDE_TXN {
            state.committed = Some(clock);
        } else if !self.txn.contains(journal)
            && self.txn.insert(journal.to_string())
            && state.committed.is_none()
        {
            // Readers that never saw this producer here take the clock
            // before its first message as its last acknowledgement.
            state.committed = Some(Clock(clock.0 - 1));
        }
        if state.buf.len() >= limit {
            let chunk = state.take_chunk(limit);
            send(journal, &state.tx, Cmd::Append(chunk)).await?;
        }
        Ok(uuid)
    }

    /// Appends what is buffered and waits until every message published so
    /// far is in its journal.
    pub async fn flush(&mut self) -> Result<(), MessageError> {
        let names: Vec<String> = self.journals.keys().cloned().collect();
        self.flush_journals(&names).await
    }

    async fn flush_journals(&mut self, names: &[String]) -> Result<(), MessageError> {
        let mut waits = Vec::new();
        for name in names {
            let state = self.journals.get_mut(name).expect("known journal");
            if !state.buf.is_empty() {
                let chunk = state.take_chunk(self.options.append_bytes_max);
                send(name, &state.tx, Cmd::Append(chunk)).await?;
            }
            let (tx, rx) = oneshot::channel();
            send(name, &state.tx, Cmd::Barrier(tx)).await?;
            waits.push((name.clone(), rx));
        }
        let mut first_err = None;
        for (name, rx) in waits {
            let r = rx.await.unwrap_or_else(|_| {
                Err(MessageError::Poisoned {
                    journal: name.clone(),
                    why: "its append task ended".into(),
                })
            });
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Commits the open transaction: appends an acknowledgement to each
    /// journal it touched and waits until everything published so far is
    /// appended. On error the transaction's outcome is unknown in the
    /// journals whose acknowledgement failed: roll back, or commit again.
    pub async fn commit(&mut self) -> Result<(), MessageError> {
        let touched: Vec<String> = self.txn.iter().cloned().collect();
        for name in &touched {
            let clock = self.tick();
            let uuid = Uuid::build(self.producer, clock, Flags::ACK_TXN);
            let state = self.journals.get_mut(name).expect("touched journal");
            state.framing.encode_ack(uuid, &mut state.buf);
            state.committed = Some(clock);
        }
        self.txn.clear();
        self.flush().await
    }

    /// Rolls the open transaction back: appends, to each journal it
    /// touched, an acknowledgement at the producer's last committed clock
    /// there, which makes readers discard the transaction's messages. Also
    /// clears the failure of an earlier append to those journals.
    pub async fn rollback(&mut self) -> Result<(), MessageError> {
        let touched: Vec<String> = self.txn.iter().cloned().collect();
        for name in &touched {
            let state = self.journals.get_mut(name).expect("touched journal");
            let clock = state
                .committed
                .expect("a touched journal has a committed clock");
            let uuid = Uuid::build(self.producer, clock, Flags::ACK_TXN);
            send(name, &state.tx, Cmd::Reset).await?;
            state.framing.encode_ack(uuid, &mut state.buf);
        }
        self.txn.clear();
        self.flush_journals(&touched).await
    }
}

async fn send(journal: &str, tx: &mpsc::Sender<Cmd>, cmd: Cmd) -> Result<(), MessageError> {
    tx.send(cmd).await.map_err(|_| MessageError::Poisoned {
        journal: journal.to_string(),
        why: "its append task ended".into(),
    })
}

/// Whether a failed append may have committed all the same.
fn outcome_unknown(e: &ClientError) -> bool {
    matches!(e, ClientError::Io { .. }) || e.status() == Some(Status::REPLICATION_FAILED)
}

/// Appends one journal's buffers in order, retrying each.
async fn append_loop(
    client: Client,
    journal: String,
    mut rx: mpsc::Receiver<Cmd>,
    retry_for: Duration,
    stats: Arc<PublisherStats>,
) {
    let mut failed: Option<(String, Option<Status>, bool)> = None;
    let req = AppendRequest {
        journal: journal.clone(),
        ..AppendRequest::default()
    };
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Cmd::Reset => failed = None,
            Cmd::Barrier(reply) => {
                let r = match failed.clone() {
                    None => Ok(()),
                    Some((why, status, retryable)) => Err(MessageError::Append {
                        journal: journal.clone(),
                        why,
                        status,
                        retryable,
                    }),
                };
                let _ = reply.send(r);
            }
            Cmd::Append(bytes) => {
                if failed.is_some() {
                    // After a failed append, later ones would commit
                    // messages behind a gap: drop them until a rollback.
                    continue;
                }
                let deadline = tokio::time::Instant::now() + retry_for;
                let mut pause = RETRY_PAUSE_MIN;
                loop {
                    match client.append(&req, bytes.clone()).await {
                        Ok(_) => {
                            stats.appends.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                            let counter = if outcome_unknown(&e) {
                                &stats.retries_unknown
                            } else {
                                &stats.retries_refused
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(RETRY_PAUSE_MAX);
                        }
                        Err(e) => {
                            let retryable = e.is_retryable();
                            failed = Some((e.to_string(), e.status(), retryable));
                            break;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_chunk_sizes_the_next_buffer() {
        let (tx, _rx) = mpsc::channel(1);
        let mut state = JournalState {
            framing: Framing::Fixed,
            buf: b"frames".to_vec(),
            tx,
            committed: None,
            chunk_len_last: 0,
        };
        assert_eq!(state.take_chunk(1024), Bytes::from_static(b"frames"));
        assert!(state.buf.is_empty());
        assert_eq!(state.chunk_len_last, 6);
        state.buf = vec![0; 40];
        assert_eq!(state.take_chunk(16).len(), 40, "a chunk is never cut");
        assert_eq!(state.chunk_len_last, 16, "reserved up to the limit");
    }
}
