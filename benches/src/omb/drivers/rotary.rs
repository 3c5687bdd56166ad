//! rotary behind the workload runner's [`Driver`] interface.
//!
//! A topic is a journal prefix and its partitions are the journals
//! `<topic>/part-NNN`, created with APPLY (replication 1, durability
//! `replicated`, and the fragment store of [`RotaryOptions`] if any). A
//! producer appends each message as one append; the reply must span exactly
//! the message's bytes. A consumer reads each of its journals from offset 0
//! with a blocking read and cuts the byte stream into messages of the
//! workload's message size: appends never interleave, so every message is
//! whole and in order. History held only by the store is fetched from the
//! store ([`Client::read_direct`]), which is the catch-up path the backlog
//! test exercises.
//!
//! Producers share one client (its connections carry many appends at
//! once); every consumer has a client of its own, so reads do not queue
//! behind appends on a connection.

use crate::omb::driver::{BoxFuture, Consumer, Driver, MessageSink, Producer, TaskConsumer};
use anyhow::Context as _;
use bytes::{Bytes, BytesMut};
use rotary_net::client::{Client, ReadEvent};
use rotary_net::spec::{Durability, JournalSpec};
use rotary_net::wire::{AppendRequest, ReadRequest};
use std::sync::Arc;
use std::time::Duration;

/// Largest partition index a journal name can carry (`part-NNN` widens
/// beyond 999 as needed, still sorting within one width).
const PARTITION_DIGITS: usize = 3;
/// Pause before a consumer reads again after a retryable failure.
const READ_RETRY_BACKOFF: Duration = Duration::from_millis(100);
/// Failed reads in a row after which a consumer gives up.
const READ_RETRIES_MAX: u32 = 100;

/// How the driver creates journals.
#[derive(Clone, Debug, Default)]
pub struct RotaryOptions {
    /// Fragment store of every journal (`file:///abs/dir/`, `s3://…`).
    pub store: Option<String>,
    /// `fragment.length` of every journal; `None` keeps the spec default.
    pub fragment_length: Option<u64>,
    pub durability: Durability,
}

/// The journal of partition `p` of `topic`.
pub fn journal_name(topic: &str, p: usize) -> String {
    format!("{topic}/part-{p:0PARTITION_DIGITS$}")
}

pub struct RotaryDriver {
    endpoint: String,
    client: Client,
    message_size: usize,
    options: RotaryOptions,
}

impl RotaryDriver {
    pub async fn connect(
        endpoint: &str,
        message_size: usize,
        options: RotaryOptions,
    ) -> anyhow::Result<RotaryDriver> {
        anyhow::ensure!(message_size > 0, "message size must be positive");
        let client = Client::connect(endpoint)
            .await
            .with_context(|| format!("connecting to rotary at {endpoint}"))?;
        client
            .ping()
            .await
            .with_context(|| format!("PING {endpoint}"))?;
        Ok(RotaryDriver {
            endpoint: endpoint.to_string(),
            client,
            message_size,
            options,
        })
    }
}

impl Driver for RotaryDriver {
    fn name(&self) -> String {
        "rotary".to_string()
    }

    fn durability(&self) -> String {
        let mut s = match self.options.durability {
            Durability::Replicated => {
                "replicated: O_DIRECT write and commit-log record before the ack, \
                 no fdatasync (survives a broker crash, not a power loss); replication 1"
            }
            Durability::Fsync => {
                "fsync: O_DIRECT write, commit-log record and fdatasync of both before \
                 the ack (survives a power loss); replication 1"
            }
        }
        .to_string();
        if let Some(store) = &self.options.store {
            s.push_str(&format!("; sealed fragments uploaded to {store}"));
        }
        s
    }

    fn create_topic<'a>(
        &'a self,
        topic: &'a str,
        partitions: usize,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move {
            let specs: Vec<JournalSpec> = (0..partitions)
                .map(|p| {
                    let mut spec = JournalSpec::new(journal_name(topic, p));
                    spec.replication = 1;
                    spec.durability = self.options.durability;
                    if let Some(store) = &self.options.store {
                        spec.fragment.stores = vec![store.clone()];
                    }
                    if let Some(len) = self.options.fragment_length {
                        spec.fragment.length = len;
                    }
                    spec
                })
                .collect();
            for spec in &specs {
                spec.validate()
                    .with_context(|| format!("journal spec of topic {topic}"))?;
            }
            self.client
                .apply(&specs)
                .await
                .with_context(|| format!("APPLY of {partitions} journals of {topic}"))?;
            Ok(())
        })
    }

    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>> {
        Box::pin(async move {
            let p: Box<dyn Producer> = Box::new(RotaryProducer {
                client: self.client.clone(),
                topic: topic.to_string(),
                requests: Default::default(),
            });
            Ok(p)
        })
    }

    fn create_consumer<'a>(
        &'a self,
        topic: &'a str,
        _subscription: &'a str,
        partitions: Vec<usize>,
        sink: MessageSink,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Consumer>>> {
        Box::pin(async move {
            // Subscriptions are independent by construction: each consumer
            // reads with offsets of its own; nothing is shared to name.
            let client = Client::connect(&self.endpoint)
                .await
                .with_context(|| format!("connecting a consumer to {}", self.endpoint))?;
            let tasks = partitions
                .into_iter()
                .map(|p| {
                    tokio::spawn(consume(
                        client.clone(),
                        journal_name(topic, p),
                        p,
                        self.message_size,
                        sink.clone(),
                    ))
                })
                .collect();
            let c: Box<dyn Consumer> = Box::new(TaskConsumer::new(tasks));
            Ok(c)
        })
    }
}

struct RotaryProducer {
    client: Client,
    topic: String,
    /// One request per partition, made on first use.
    requests: std::sync::Mutex<std::collections::HashMap<usize, Arc<AppendRequest>>>,
}

impl RotaryProducer {
    fn request(&self, partition: usize) -> Arc<AppendRequest> {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(partition)
            .or_insert_with(|| {
                Arc::new(AppendRequest {
                    journal: journal_name(&self.topic, partition),
                    ..Default::default()
                })
            })
            .clone()
    }
}

impl Producer for RotaryProducer {
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>> {
        let client = self.client.clone();
        let req = self.request(partition);
        Box::pin(async move {
            let len = payload.len() as u64;
            let reply = client
                .append(&req, payload)
                .await
                .with_context(|| format!("append to {}", req.journal))?;
            anyhow::ensure!(
                reply.end.checked_sub(reply.begin) == Some(len),
                "append to {}: reply [{}, {}) does not span the {len} bytes sent",
                req.journal,
                reply.begin,
                reply.end
            );
            Ok(())
        })
    }
}

/// Cuts a byte stream into messages of one size, whatever the stream's
/// chunking.
pub struct Splitter {
    size: usize,
    partial: BytesMut,
}

impl Splitter {
    pub fn new(size: usize) -> Splitter {
        assert!(size > 0);
        Splitter {
            size,
            partial: BytesMut::new(),
        }
    }

    /// Hands every message completed by `chunk` to `each`.
    pub fn push(&mut self, mut chunk: &[u8], mut each: impl FnMut(&[u8])) {
        if !self.partial.is_empty() {
            let need = self.size - self.partial.len();
            let take = need.min(chunk.len());
            self.partial.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.partial.len() < self.size {
                return;
            }
            each(&self.partial);
            self.partial.clear();
        }
        let mut whole = chunk.chunks_exact(self.size);
        for m in whole.by_ref() {
            each(m);
        }
        self.partial.extend_from_slice(whole.remainder());
    }

    /// Bytes of an incomplete message held back.
    pub fn pending(&self) -> usize {
        self.partial.len()
    }
}

/// Reads `journal` from offset 0 until aborted, handing each message to
/// `sink`.
async fn consume(
    client: Client,
    journal: String,
    partition: usize,
    message_size: usize,
    sink: MessageSink,
) -> anyhow::Result<()> {
    let mut offset = 0u64;
    let mut split = Splitter::new(message_size);
    let mut failures = 0u32;
    loop {
        let req = ReadRequest {
            journal: journal.clone(),
            offset: Some(offset),
            end_offset: None,
            route_revision: 0,
        };
        let mut read = client.read_direct(&req, true);
        let why = loop {
            match read.next().await {
                Some(Ok(ReadEvent::Data {
                    offset: at,
                    content,
                })) => {
                    anyhow::ensure!(
                        at == offset,
                        "{journal}: read returned offset {at}, expected {offset} (missing history)"
                    );
                    offset += content.len() as u64;
                    failures = 0;
                    split.push(&content, |m| sink(partition, m));
                }
                Some(Ok(ReadEvent::Done(done))) => match done.check() {
                    // A read may end (e.g. at a route change); read on.
                    Ok(()) => break None,
                    Err(e) => break Some(e),
                },
                Some(Ok(ReadEvent::Fragment { .. })) => {
                    anyhow::bail!("{journal}: a direct read yielded a fragment location")
                }
                Some(Err(e)) => break Some(e),
                None => break None,
            }
        };
        if let Some(e) = why {
            failures += 1;
            if !e.is_retryable() || failures > READ_RETRIES_MAX {
                return Err(anyhow::Error::new(e).context(format!("reading {journal} at {offset}")));
            }
            tokio::time::sleep(READ_RETRY_BACKOFF).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitter_cuts_whole_messages_across_chunks() {
        let stream: Vec<u8> = (0..100u8).collect();
        for cut in [1, 3, 7, 10, 33, 100] {
            let mut s = Splitter::new(10);
            let mut out = Vec::new();
            for chunk in stream.chunks(cut) {
                s.push(chunk, |m| out.push(m.to_vec()));
            }
            assert_eq!(out.len(), 10, "cut {cut}");
            for (i, m) in out.iter().enumerate() {
                assert_eq!(m, &stream[i * 10..(i + 1) * 10]);
            }
            assert_eq!(s.pending(), 0);
        }
        let mut s = Splitter::new(10);
        s.push(&stream[..15], |_| {});
        assert_eq!(s.pending(), 5);
    }

    #[test]
    fn journal_names_are_valid() {
        let name = journal_name("omb-1700000000-42-t000", 7);
        assert_eq!(name, "omb-1700000000-42-t000/part-007");
        rotary_net::spec::validate_journal_name(&name).unwrap();
        assert_eq!(journal_name("t", 1234), "t/part-1234");
    }
}
