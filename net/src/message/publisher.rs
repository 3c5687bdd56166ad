//! The publisher: frames messages, gives each its UUID in the order its
//! journal receives it, and appends them, retrying unknown outcomes.
//!
//! Each journal written gets a task that appends its messages one append
//! at a time. Messages are framed into the journal's buffer as they are
//! published, with the clock ticked at that moment, so the journal's bytes
//! are in clock order however many journals are written at once; a buffer
//! goes to its task once it holds [`PublisherOptions::append_bytes_max`]
//! bytes, and at every flush, commit or rollback, which then wait for it.
//! A flush whose journal's task has nothing queued appends the buffer
//! itself, in the caller's task, instead of handing it over and waiting
//! for the task's answer: the same append, without the two hand-offs
//! between tasks a commit would otherwise wait on. A failed append is sent
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// Why a journal's appends stopped: later ones are dropped until a
/// rollback resets it, since they would commit messages behind a gap.
#[derive(Clone, Debug)]
struct Failure {
    why: String,
    status: Option<Status>,
    retryable: bool,
}

impl Failure {
    fn of(e: &ClientError) -> Failure {
        Failure {
            why: e.to_string(),
            status: e.status(),
            retryable: e.is_retryable(),
        }
    }

    fn error(self, journal: &str) -> MessageError {
        MessageError::Append {
            journal: journal.to_string(),
            why: self.why,
            status: self.status,
            retryable: self.retryable,
        }
    }
}

/// What a journal's publisher and its append task share.
#[derive(Debug, Default)]
struct Shared {
    /// Commands sent to the task that it has not finished: while it is 0
    /// the task is idle and the publisher may append itself.
    queued: AtomicUsize,
    /// The first failure since the last reset.
    failed: Mutex<Option<Failure>>,
}

impl Shared {
    fn is_idle(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0
    }

    fn failure(&self) -> Option<Failure> {
        self.failed.lock().expect("not poisoned").clone()
    }

    fn set_failure(&self, f: Option<Failure>) {
        *self.failed.lock().expect("not poisoned") = f;
    }

    /// Called by the task once it is done with a command.
    fn done(&self) {
        let before = self.queued.fetch_sub(1, Ordering::Release);
        debug_assert!(before > 0, "a command done was counted when sent");
    }
}

struct JournalState {
    framing: Framing,
    buf: Vec<u8>,
    tx: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
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

    /// Hands `cmd` to the journal's task.
    async fn send(&self, journal: &str, cmd: Cmd) -> Result<(), MessageError> {
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(cmd).await.map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            MessageError::Poisoned {
                journal: journal.to_string(),
                why: "its append task ended".into(),
            }
        })
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
            let shared = Arc::new(Shared::default());
            tokio::spawn(append_loop(self.appender(journal), rx, shared.clone()));
            self.journals.insert(
                journal.to_string(),
                JournalState {
                    framing,
                    buf: Vec::new(),
                    tx,
                    shared,
                    committed: None,
                    chunk_len_last: 0,
                },
            );
        }
        self.journals.get_mut(journal).expect("inserted")
    }

    #[allow(clippy::disallowed_methods)] // The retry window is a tokio timer's, on tokio's clock.
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
            state.send(journal, Cmd::Append(chunk)).await?;
        }
        Ok(uuid)
    }

    /// Appends what is buffered and waits until every message published so
    /// far is in its journal. On error every journal whose append failed
    /// is named ([`MessageError::failed_journals`]); each takes no more
    /// messages until a rollback (in the open transaction) or a
    /// [`Publisher::reset`] (outside it).
    pub async fn flush(&mut self) -> Result<(), MessageError> {
        let names: Vec<String> = self.journals.keys().cloned().collect();
        self.flush_journals(&names).await
    }

    /// Appends the journals' buffers and waits for every append queued
    /// before them: a journal whose task is idle is appended here, the
    /// others by their tasks, all at once.
    async fn flush_journals(&mut self, names: &[String]) -> Result<(), MessageError> {
        let mut inline = Vec::new();
        let mut waits = Vec::new();
        for name in names {
            let appender = self.appender(name);
            let state = self.journals.get_mut(name).expect("known journal");
            let chunk =
                (!state.buf.is_empty()).then(|| state.take_chunk(self.options.append_bytes_max));
            if state.shared.is_idle() {
                let append = InlineAppend {
                    chunk,
                    tx: state.tx.clone(),
                    shared: state.shared.clone(),
                };
                inline.push(append.run(appender));
                continue;
            }
            if let Some(chunk) = chunk {
                state.send(name, Cmd::Append(chunk)).await?;
            }
            let (tx, rx) = oneshot::channel();
            state.send(name, Cmd::Barrier(tx)).await?;
            waits.push(async move {
                rx.await.unwrap_or_else(|_| {
                    Err(MessageError::Poisoned {
                        journal: name.clone(),
                        why: "its append task ended".into(),
                    })
                })
            });
        }
        let (inline, waits) = futures_util::future::join(
            futures_util::future::join_all(inline),
            futures_util::future::join_all(waits),
        )
        .await;
        MessageError::of_all(
            inline
                .into_iter()
                .chain(waits)
                .filter_map(Result::err)
                .collect(),
        )
    }

    /// Clears the failure of `journal`, a journal outside the open
    /// transaction whose append failed (see [`MessageError::failed_journals`]):
    /// its messages not yet appended (the failed append's, and any queued
    /// or buffered after it) are dropped, and it takes messages again. A
    /// journal of the open transaction is cleared by
    /// [`Publisher::rollback`] instead.
    pub async fn reset(&mut self, journal: &str) -> Result<(), MessageError> {
        if self.txn.contains(journal) {
            return Err(MessageError::Poisoned {
                journal: journal.to_string(),
                why: "it is in the open transaction, which a reset does not end".into(),
            });
        }
        let Some(state) = self.journals.get_mut(journal) else {
            return Ok(());
        };
        state.buf.clear();
        if state.shared.is_idle() {
            state.shared.set_failure(None);
            Ok(())
        } else {
            // After the appends queued before it, which the failure drops.
            state.send(journal, Cmd::Reset).await
        }
    }

    /// How `journal` is appended to, by its task or at a flush.
    fn appender(&self, journal: &str) -> Appender {
        Appender {
            client: self.client.clone(),
            req: AppendRequest {
                journal: journal.to_string(),
                ..AppendRequest::default()
            },
            retry_for: self.options.retry_for,
            stats: self.stats.clone(),
        }
    }

    /// Commits the open transaction: appends an acknowledgement to each
    /// journal it touched and waits until everything published so far is
    /// appended. On error the journals whose appends failed stay in the
    /// transaction, at their last committed clock, and take no more
    /// messages until [`Publisher::rollback`] discards what of it they
    /// hold (the transaction's outcome there is unknown: some of its
    /// messages, or all of them, may have been appended).
    pub async fn commit(&mut self) -> Result<(), MessageError> {
        let touched: Vec<String> = self.txn.iter().cloned().collect();
        let mut last_committed = Vec::with_capacity(touched.len());
        for name in &touched {
            let clock = self.tick();
            let uuid = Uuid::build(self.producer, clock, Flags::ACK_TXN);
            let state = self.journals.get_mut(name).expect("touched journal");
            state.framing.encode_ack(uuid, &mut state.buf);
            last_committed.push(state.committed.replace(clock));
        }
        self.txn.clear();
        let flushed = self.flush().await;
        if flushed.is_err() {
            self.keep_failed_in_txn(touched.into_iter().zip(last_committed));
        }
        flushed
    }

    /// After a failed commit or rollback: the journals (of those it
    /// touched) whose appends failed stay in the transaction, at the
    /// committed clock given, so that a rollback reaches them.
    fn keep_failed_in_txn(&mut self, touched: impl Iterator<Item = (String, Option<Clock>)>) {
        for (name, committed) in touched {
            let state = self.journals.get_mut(&name).expect("touched journal");
            if state.shared.failure().is_some() {
                state.committed = committed;
                self.txn.insert(name);
            }
        }
    }

    /// Rolls the open transaction back: appends, to each journal it
    /// touched, an acknowledgement at the producer's last committed clock
    /// there, which makes readers discard the transaction's messages. Also
    /// clears the failure of an earlier append to those journals. On error
    /// the journals whose acknowledgement failed stay in the transaction,
    /// to roll back again.
    pub async fn rollback(&mut self) -> Result<(), MessageError> {
        let touched: Vec<String> = self.txn.iter().cloned().collect();
        for name in &touched {
            let state = self.journals.get_mut(name).expect("touched journal");
            let clock = state
                .committed
                .expect("a touched journal has a committed clock");
            let uuid = Uuid::build(self.producer, clock, Flags::ACK_TXN);
            if state.shared.is_idle() {
                state.shared.set_failure(None);
            } else {
                state.send(name, Cmd::Reset).await?;
            }
            state.framing.encode_ack(uuid, &mut state.buf);
        }
        self.txn.clear();
        let flushed = self.flush_journals(&touched).await;
        if flushed.is_err() {
            let committed: Vec<Option<Clock>> =
                touched.iter().map(|n| self.journals[n].committed).collect();
            self.keep_failed_in_txn(touched.into_iter().zip(committed));
        }
        flushed
    }
}

/// Whether a failed append may have committed all the same.
fn outcome_unknown(e: &ClientError) -> bool {
    matches!(e, ClientError::Io { .. }) || e.status() == Some(Status::REPLICATION_FAILED)
}

/// Appends to one journal, retrying.
struct Appender {
    client: Client,
    req: AppendRequest,
    retry_for: Duration,
    stats: Arc<PublisherStats>,
}

impl Appender {
    /// Appends `bytes`, sending them again while the failure is retryable,
    /// for up to `retry_for`.
    #[allow(clippy::disallowed_methods)] // The retry window is a tokio timer's, on tokio's clock.
    async fn append(&self, bytes: Bytes) -> Result<(), Failure> {
        let deadline = tokio::time::Instant::now() + self.retry_for;
        let mut pause = RETRY_PAUSE_MIN;
        loop {
            match self.client.append(&self.req, bytes.clone()).await {
                Ok(_) => {
                    self.stats.appends.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                    let counter = if outcome_unknown(&e) {
                        &self.stats.retries_unknown
                    } else {
                        &self.stats.retries_refused
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                Err(e) => return Err(Failure::of(&e)),
            }
        }
    }

    /// Appends `bytes` unless an earlier append failed (they are dropped);
    /// a failure stops the journal's later appends.
    async fn append_unless_failed(&self, shared: &Shared, bytes: Bytes) -> Result<(), Failure> {
        if let Some(f) = shared.failure() {
            return Err(f);
        }
        let r = self.append(bytes).await;
        if let Err(f) = &r {
            shared.set_failure(Some(f.clone()));
        }
        r
    }
}

/// A flush's append made in the caller's task, while the journal's task is
/// idle. Dropped before it is done (the caller's flush was cancelled), it
/// hands its bytes to the task, which appends them as it would have: they
/// may have been sent already, and a copy appended twice is a duplicate
/// readers drop.
struct InlineAppend {
    chunk: Option<Bytes>,
    tx: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
}

impl InlineAppend {
    async fn run(mut self, appender: Appender) -> Result<(), MessageError> {
        let journal = &appender.req.journal;
        let r = match self.chunk.clone() {
            Some(chunk) => appender.append_unless_failed(&self.shared, chunk).await,
            None => self.shared.failure().map_or(Ok(()), Err),
        };
        self.chunk = None;
        r.map_err(|f| f.error(journal))
    }
}

impl Drop for InlineAppend {
    fn drop(&mut self) {
        let Some(chunk) = self.chunk.take() else {
            return;
        };
        // The task is idle (nothing else can be queued while the flush
        // that made this holds the publisher), so its queue has room.
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        if self.tx.try_send(Cmd::Append(chunk)).is_err() {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Appends one journal's buffers in order, retrying each.
async fn append_loop(appender: Appender, mut rx: mpsc::Receiver<Cmd>, shared: Arc<Shared>) {
    let journal = appender.req.journal.clone();
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Cmd::Reset => shared.set_failure(None),
            Cmd::Barrier(reply) => {
                let r = shared.failure().map_or(Ok(()), |f| Err(f.error(&journal)));
                // Done before it answers: the flush it wakes finds the
                // task idle.
                shared.done();
                let _ = reply.send(r);
                continue;
            }
            Cmd::Append(bytes) => {
                // A failure is kept in `shared`; the flush's barrier reports it.
                let _ = appender.append_unless_failed(&shared, bytes).await;
            }
        }
        shared.done();
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
            shared: Arc::default(),
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

    /// A flush cancelled while it appended a journal itself leaves the
    /// bytes to the journal's task, counted as queued; one that finished
    /// leaves nothing.
    #[tokio::test]
    async fn an_inline_append_dropped_unfinished_hands_its_bytes_to_the_task() {
        let (tx, mut rx) = mpsc::channel(QUEUED_APPENDS_MAX);
        let shared = Arc::new(Shared::default());
        let unfinished = InlineAppend {
            chunk: Some(Bytes::from_static(b"frames")),
            tx: tx.clone(),
            shared: shared.clone(),
        };
        drop(unfinished);
        assert!(!shared.is_idle(), "the task has a command to finish");
        match rx.try_recv() {
            Ok(Cmd::Append(b)) => assert_eq!(b, Bytes::from_static(b"frames")),
            _ => panic!("the bytes went to the task"),
        }
        shared.done();
        assert!(shared.is_idle());

        let finished = InlineAppend {
            chunk: None,
            tx,
            shared: shared.clone(),
        };
        drop(finished);
        assert!(
            shared.is_idle() && rx.try_recv().is_err(),
            "nothing to hand over"
        );
    }
}
