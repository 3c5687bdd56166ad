//! Reading messages from journals: read uncommitted (every message, in
//! each journal's order, duplicates and acknowledgements included) or read
//! committed (through a [`Sequencer`]).
//!
//! Each journal is read by its own task, which decodes frames and hands
//! envelopes to the reader through one bounded channel; a read that fails
//! (a broker restarting) is started again where the last whole message
//! ended, for up to [`ReaderOptions::retry_for`] of failing without
//! progress. Journals are interleaved as their bytes arrive: no journal or
//! producer waits for another.

use super::framing::{Decoder, Framing, CONTENT_TYPE_LABEL, UUID_POINTER_DEFAULT};
use super::sequencer::{Checkpoint, Sequencer, RING_LEN_DEFAULT};
use super::{Envelope, MessageError};
use crate::client::{Client, ClientError, ReadEvent, ReadStream};
use crate::status::Status;
use crate::wire::ReadRequest;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Batches of envelopes decoded but not yet taken by the reader, over all
/// journals: each holds the messages of one piece of a journal read (at
/// most a read frame's bytes), sent together so that a message costs no
/// channel send of its own.
pub const BATCHES_BUFFERED_MAX: usize = 32;
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(50);
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Which messages a reader delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// Each committed message once, in commit order per producer.
    Committed,
    /// Everything, as it is in the journals.
    Uncommitted,
}

/// How a [`Reader`] reads.
#[derive(Clone, Debug)]
pub struct ReaderOptions {
    pub mode: ReadMode,
    /// Keep reading at the write heads; without it the reader ends once
    /// every journal has been read to its write head.
    pub block: bool,
    /// Pending transaction messages held in memory (see [`Sequencer`]).
    pub ring_len: usize,
    /// Where to start journals the checkpoint does not name.
    pub offset: u64,
    /// Position to continue from.
    pub checkpoint: Option<Checkpoint>,
    /// How long a read may keep failing before the reader gives up.
    pub retry_for: Duration,
    /// Where JSON-lines messages hold their UUID.
    pub uuid_pointer: String,
    /// Framing of journals without a `content-type` label; `None` refuses them.
    pub default_framing: Option<Framing>,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            mode: ReadMode::Committed,
            block: false,
            ring_len: RING_LEN_DEFAULT,
            offset: 0,
            checkpoint: None,
            retry_for: Duration::from_secs(120),
            uuid_pointer: UUID_POINTER_DEFAULT.to_string(),
            default_framing: None,
        }
    }
}

enum Fetched {
    /// Envelopes in journal order, each with the bytes its journal had
    /// skipped as damaged frames once it was decoded.
    Envelopes(Vec<(Envelope, u64)>),
    Failed(MessageError),
}

struct Replay {
    journal: Arc<str>,
    end: u64,
    decoder: Decoder,
    stream: Option<ReadStream>,
    out: VecDeque<Envelope>,
    /// The range has been read to its end.
    done: bool,
    retry: Retry,
}

/// Reads messages from journals (see the module documentation).
pub struct Reader {
    client: Client,
    mode: ReadMode,
    retry_for: Duration,
    seq: Sequencer,
    framings: BTreeMap<Arc<str>, Framing>,
    skipped: BTreeMap<Arc<str>, u64>,
    rx: mpsc::Receiver<Fetched>,
    /// The rest of the batch last received.
    fetched: std::collections::VecDeque<(Envelope, u64)>,
    tasks: Vec<JoinHandle<()>>,
    replay: Option<Replay>,
    /// Replays read on their own connections: a journal's read stalled
    /// behind the full envelope channel holds up its connection's other
    /// replies, and would hold up the replay the reader waits for.
    replay_client: Option<Client>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("mode", &self.mode)
            .field("journals", &self.framings.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Reader {
    /// Starts reading `journals`, whose framing comes from their
    /// `content-type` labels.
    pub async fn open(
        client: Client,
        journals: &[String],
        options: ReaderOptions,
    ) -> Result<Reader, MessageError> {
        let listed = client.list("").await?;
        let mut framings = BTreeMap::new();
        for name in journals {
            let info = listed
                .iter()
                .find(|j| &j.spec.name == name)
                .ok_or_else(|| MessageError::JournalNotFound {
                    journal: name.clone(),
                })?;
            let ct = info.spec.labels.values_of(CONTENT_TYPE_LABEL).next();
            let framing = match (ct, &options.default_framing) {
                (None, Some(f)) => f.clone(),
                (ct, _) => Framing::from_content_type(name, ct, &options.uuid_pointer)?,
            };
            framings.insert(Arc::<str>::from(name.as_str()), framing);
        }
        Reader::open_with(client, framings, options)
    }

    /// Starts reading the journals named, with the framings given.
    pub fn open_with(
        client: Client,
        framings: BTreeMap<Arc<str>, Framing>,
        options: ReaderOptions,
    ) -> Result<Reader, MessageError> {
        let mut seq = match &options.checkpoint {
            Some(cp) => Sequencer::from_checkpoint(cp, options.ring_len)?,
            None => Sequencer::new(options.ring_len),
        };
        let (tx, rx) = mpsc::channel(BATCHES_BUFFERED_MAX);
        let mut tasks = Vec::new();
        for (journal, framing) in &framings {
            let offset = seq.offset(journal).unwrap_or(options.offset);
            seq.set_offset(journal, offset);
            let decoder = Decoder::new(journal.clone(), framing.clone(), offset);
            tasks.push(tokio::spawn(read_loop(
                client.clone(),
                decoder,
                options.block,
                options.retry_for,
                tx.clone(),
            )));
        }
        Ok(Reader {
            client,
            mode: options.mode,
            retry_for: options.retry_for,
            seq,
            skipped: framings.keys().map(|j| (j.clone(), 0)).collect(),
            framings,
            rx,
            fetched: std::collections::VecDeque::new(),
            tasks,
            replay: None,
            replay_client: None,
        })
    }

    /// The position to continue from later: every message returned so far
    /// counts as processed.
    pub fn checkpoint(&self) -> Checkpoint {
        self.seq.checkpoint()
    }

    /// Bytes of `journal` skipped as damaged frames so far.
    pub fn skipped_bytes(&self, journal: &str) -> u64 {
        self.skipped.get(journal).copied().unwrap_or(0)
    }

    /// The next message; `None` once every journal was read to its write
    /// head (never, with `block`).
    pub async fn next(&mut self) -> Option<Result<Envelope, MessageError>> {
        loop {
            if self.replay.is_some() {
                match self.replay_next().await {
                    Ok(Some(env)) => return Some(Ok(env)),
                    Ok(None) => {
                        self.replay = None;
                        self.seq.finish_replay();
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
            if let Some(env) = self.seq.pop() {
                return Some(Ok(env));
            }
            if let Some((journal, begin, end)) = self.seq.replay_range() {
                let framing = self.framings.get(&journal).expect("a journal read").clone();
                self.replay = Some(Replay {
                    decoder: Decoder::new(journal.clone(), framing, begin),
                    journal,
                    end,
                    stream: None,
                    out: VecDeque::new(),
                    done: false,
                    retry: Retry::new(self.retry_for),
                });
                continue;
            }
            // Envelopes are queued until one commits: only then is there
            // anything to dequeue or replay.
            loop {
                if self.fetched.is_empty() {
                    match self.rx.recv().await? {
                        Fetched::Envelopes(batch) => self.fetched = batch.into(),
                        Fetched::Failed(e) => return Some(Err(e)),
                    }
                }
                if self.mode == ReadMode::Committed && self.queue_txn() {
                    break;
                }
                let (env, skipped_bytes) = self.fetched.pop_front()?;
                self.note_skipped(&env.journal, skipped_bytes);
                match self.mode {
                    ReadMode::Uncommitted => {
                        self.seq.read_through(&env);
                        return Some(Ok(env));
                    }
                    ReadMode::Committed if self.seq.queue(env).commits() => break,
                    ReadMode::Committed => {}
                }
            }
        }
    }

    /// Hands the sequencer the whole transaction at the front of the batch,
    /// if there is one ([`Sequencer::txn_at_front`]).
    fn queue_txn(&mut self) -> bool {
        let front = self.fetched.iter().map(|(env, _)| env);
        let Some(n) = self.seq.txn_at_front(front) else {
            return false;
        };
        let mut skipped_bytes = 0;
        let txn: Vec<Envelope> = self
            .fetched
            .drain(..n)
            .map(|(env, s)| {
                skipped_bytes = s;
                env
            })
            .collect();
        self.note_skipped(&txn[0].journal, skipped_bytes);
        self.seq.queue_txn(txn);
        true
    }

    /// Bytes of `journal` skipped as damaged frames, as of the envelope
    /// just taken.
    fn note_skipped(&mut self, journal: &Arc<str>, bytes: u64) {
        match self.skipped.get_mut(&**journal) {
            Some(s) => *s = bytes,
            None => {
                self.skipped.insert(journal.clone(), bytes);
            }
        }
    }

    async fn replay_next(&mut self) -> Result<Option<Envelope>, MessageError> {
        if self.replay_client.is_none() {
            let c = Client::connect(self.client.endpoint()).await?;
            self.replay_client = Some(c);
        }
        let client = self.replay_client.as_ref().expect("connected");
        let r = self.replay.as_mut().expect("replaying");
        loop {
            // The sequencer takes each replayed envelope only as it is
            // handed out, so that a checkpoint taken between two `next`
            // calls never counts one still waiting here as delivered.
            while let Some(env) = r.out.pop_front() {
                if let Some(d) = self.seq.replay(env)? {
                    return Ok(Some(d));
                }
            }
            let at = r.decoder.offset();
            if r.done || at >= r.end {
                return Ok(None);
            }
            let stream = match r.stream.as_mut() {
                Some(s) => s,
                None => {
                    let req = ReadRequest {
                        journal: r.journal.to_string(),
                        offset: Some(at),
                        end_offset: Some(r.end),
                        route_revision: 0,
                    };
                    match client.read(&req, false, false).await {
                        Ok(s) => r.stream.insert(s),
                        Err(e) => {
                            r.retry.failed(e).await?;
                            continue;
                        }
                    }
                }
            };
            match stream.next().await {
                Some(Ok(ReadEvent::Data { offset, content })) => {
                    r.retry.progress();
                    r.decoder.push_bytes(offset, content);
                    while let Some(env) = r.decoder.next_envelope() {
                        r.out.push_back(env);
                    }
                }
                Some(Ok(ReadEvent::Done(done))) => {
                    r.stream = None;
                    if done.status == Status::OK && done.offset >= r.end {
                        // Bytes left undecoded before the end were damage.
                        r.done = true;
                        continue;
                    }
                    if let Err(e) = done.check() {
                        r.retry.failed(e).await?;
                    }
                }
                Some(Ok(ReadEvent::Fragment { .. })) => {
                    unreachable!("fragments are proxied: do_not_proxy is not set")
                }
                Some(Err(e)) => {
                    r.stream = None;
                    r.retry.failed(e).await?;
                }
                None => r.stream = None,
            }
        }
    }
}

/// How long a read may keep failing.
struct Retry {
    retry_for: Duration,
    deadline: Option<tokio::time::Instant>,
    pause: Duration,
}

impl Retry {
    fn new(retry_for: Duration) -> Retry {
        Retry {
            retry_for,
            deadline: None,
            pause: RETRY_PAUSE_MIN,
        }
    }

    fn progress(&mut self) {
        self.deadline = None;
        self.pause = RETRY_PAUSE_MIN;
    }

    /// Waits before trying again, or returns the error if it is not
    /// retryable or has kept failing for too long.
    #[allow(clippy::disallowed_methods)] // The retry window is a tokio timer's, on tokio's clock.
    async fn failed(&mut self, e: ClientError) -> Result<(), MessageError> {
        let now = tokio::time::Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.retry_for);
        if !e.is_retryable() || now >= deadline {
            return Err(e.into());
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(RETRY_PAUSE_MAX);
        Ok(())
    }
}

/// Reads one journal, decoding its messages, until its write head (or
/// forever with `block`).
async fn read_loop(
    client: Client,
    mut decoder: Decoder,
    block: bool,
    retry_for: Duration,
    tx: mpsc::Sender<Fetched>,
) {
    let journal = decoder.journal();
    let mut retry = Retry::new(retry_for);
    loop {
        let req = ReadRequest {
            journal: journal.to_string(),
            offset: Some(decoder.offset()),
            end_offset: None,
            route_revision: 0,
        };
        let failure = match client.read(&req, block, false).await {
            Err(e) => Some(e),
            Ok(mut stream) => loop {
                match stream.next().await {
                    Some(Ok(ReadEvent::Data { offset, content })) => {
                        retry.progress();
                        decoder.push_bytes(offset, content);
                        let mut batch = Vec::new();
                        while let Some(env) = decoder.next_envelope() {
                            batch.push((env, decoder.skipped_bytes()));
                        }
                        if !batch.is_empty() && tx.send(Fetched::Envelopes(batch)).await.is_err() {
                            return; // the reader is gone
                        }
                    }
                    Some(Ok(ReadEvent::Done(done))) => {
                        let at_head =
                            matches!(done.status, Status::OK | Status::OFFSET_NOT_YET_AVAILABLE);
                        if at_head && !block {
                            return;
                        }
                        if at_head {
                            // A blocking read the broker ended: read on,
                            // after a pause in case it keeps ending.
                            tokio::time::sleep(RETRY_PAUSE_MIN).await;
                            break None;
                        }
                        break done.check().err();
                    }
                    Some(Ok(ReadEvent::Fragment { .. })) => {
                        unreachable!("fragments are proxied: do_not_proxy is not set")
                    }
                    Some(Err(e)) => break Some(e),
                    // The stream ended without READ_DONE: the connection broke.
                    None => break None,
                }
            },
        };
        let Some(failure) = failure else {
            continue;
        };
        if let Err(e) = retry.failed(failure).await {
            let _ = tx.send(Fetched::Failed(e)).await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::uuid::{Clock, Flags, ProducerId, Uuid};
    use std::future::Future;
    use std::task::Poll;

    const A: ProducerId = ProducerId([0x01, 0, 0, 0, 0, 0xa]);

    fn env(journal: &Arc<str>, at: u64, clock: u64, flags: Flags) -> (Envelope, u64) {
        let env = Envelope {
            journal: journal.clone(),
            begin: at,
            end: at + 10,
            uuid: Uuid::build(A, Clock(clock), flags),
            message: bytes::Bytes::from(format!("{clock}")),
        };
        (env, 0)
    }

    /// A `next` dropped while it replays a commit (the broker has not
    /// answered) leaves a checkpoint that replays the whole transaction.
    #[tokio::test]
    async fn a_next_dropped_mid_replay_checkpoints_before_the_commit() {
        // A broker that takes connections and never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = Client::connect(&silent.local_addr().unwrap().to_string())
            .await
            .unwrap();
        let options = ReaderOptions {
            ring_len: 1,
            ..ReaderOptions::default()
        };
        let mut reader = Reader::open_with(client, BTreeMap::new(), options).unwrap();
        let journal: Arc<str> = "a/j".into();
        reader.framings.insert(journal.clone(), Framing::json());
        reader.seq.set_offset("a/j", 0);
        // The ring of 1 lets A1 go: its acknowledgement needs a replay.
        reader.fetched = VecDeque::from([
            env(&journal, 0, 1, Flags::CONTINUE_TXN),
            env(&journal, 10, 2, Flags::CONTINUE_TXN),
            env(&journal, 20, 3, Flags::ACK_TXN),
        ]);
        {
            let mut next = std::pin::pin!(reader.next());
            let polled = std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await;
            assert!(polled.is_pending(), "the replay waits for the broker");
        }
        assert!(reader.replay.is_some() && reader.fetched.is_empty());
        let cp = reader.checkpoint();
        assert_eq!(cp.offsets["a/j"], 20, "the acknowledgement is read again");
        let a = &cp.producers[0];
        assert_eq!((a.last_ack, a.begin), (0, Some(0)), "from A1 on");
        // Restored, the acknowledgement replays A1 and A2 again.
        let mut seq = Sequencer::from_checkpoint(&cp, 1).unwrap();
        let (ack, _) = env(&journal, 20, 3, Flags::ACK_TXN);
        assert!(seq.queue(ack).commits());
        assert_eq!(seq.replay_range(), Some((journal, 0, 20)));
        drop(silent);
    }
}
