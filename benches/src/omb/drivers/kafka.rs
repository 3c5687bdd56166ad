//! The Kafka protocol, driven through `rskafka` (pure Rust, no librdkafka),
//! for any broker that speaks it (the peers script runs `tansu`).
//!
//! A topic is created with its partitions and replication factor 1. A send
//! hands one record to the partition's batching producer, which produces
//! what gathered within [`LINGER`] (at most [`BATCH_BYTES_MAX`]) as one
//! request with `acks = -1` (all in-sync replicas; rskafka always asks for
//! that) and no compression; the send resolves on the broker's response to
//! its batch. Those are the producer settings of OpenMessaging's Kafka
//! driver (`linger.ms=1`, `batch.size=1048576`, `acks=all`), the ones the
//! published Kafka comparisons ran with: the Kafka protocol batches in the
//! client, where rotary, NATS and Redis batch in the server. A consumer
//! fetches each of its partitions from the earliest offset, without a
//! consumer group, so every subscription reads everything independently.
//!
//! What an ack means on disk is the broker's setting, which the protocol
//! does not tell a client: the script that starts the broker says it in
//! `ROTARY_PEER_FSYNC`, and [`Driver::durability`] repeats it.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::omb::driver::{BoxFuture, Consumer, Driver, MessageSink, Producer, TaskConsumer};
use anyhow::Context as _;
use bytes::Bytes;
use futures_util::StreamExt;
use rskafka::chrono::{DateTime, Utc};
use rskafka::client::consumer::{StartOffset, StreamConsumerBuilder};
use rskafka::client::partition::{Compression, PartitionClient, UnknownTopicHandling};
use rskafka::client::producer::aggregator::RecordAggregator;
use rskafka::client::producer::{BatchProducer, BatchProducerBuilder};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the broker may take to create a topic.
const CREATE_TOPIC_TIMEOUT_MS: i32 = 30_000;
/// How long a send waits for others to share its produce request
/// (OpenMessaging's Kafka driver: `linger.ms=1`).
const LINGER: Duration = Duration::from_millis(1);
/// Largest batch of records in one produce request (OpenMessaging's Kafka
/// driver: `batch.size=1048576`), raised to the message size when a
/// message is larger, so that every message fits a batch of its own.
const BATCH_BYTES_MAX: usize = 1 << 20;
/// How long a fetch may wait on the broker for new records. Kafka answers
/// as soon as a record is there, so this only paces idle polling; tansu
/// 0.6 holds every fetch for the whole wait even when records are ready,
/// so the wait is also a floor under its end-to-end latency: kept short.
const FETCH_WAIT_MS: i32 = 10;
/// Bytes one fetch asks for at most; above the largest workload message.
const FETCH_BYTES_MAX: i32 = 8 << 20;

/// A connection to one Kafka-protocol broker (or cluster).
pub struct Kafka {
    client: Client,
    batch_bytes_max: usize,
}

/// Connects to the Kafka-protocol broker at `endpoint` (`HOST:PORT`) for
/// messages of `message_size` bytes.
pub async fn connect(endpoint: &str, message_size: usize) -> anyhow::Result<Box<dyn Driver>> {
    let client = ClientBuilder::new(vec![endpoint.to_string()])
        .client_id("rotary-bench")
        .build()
        .await
        .with_context(|| format!("connecting to the Kafka broker at {endpoint}"))?;
    Ok(Box::new(Kafka {
        client,
        batch_bytes_max: BATCH_BYTES_MAX.max(message_size),
    }))
}

/// A topic name Kafka accepts: ASCII letters, digits, `.`, `_` and `-`.
fn topic_name(topic: &str) -> String {
    topic
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn partition_index(partition: usize) -> anyhow::Result<i32> {
    i32::try_from(partition).with_context(|| format!("partition {partition} is out of range"))
}

impl Kafka {
    async fn partition_client(
        &self,
        topic: &str,
        partition: usize,
    ) -> anyhow::Result<Arc<PartitionClient>> {
        let client = self
            .client
            .partition_client(
                topic,
                partition_index(partition)?,
                UnknownTopicHandling::Retry,
            )
            .await
            .with_context(|| format!("finding the leader of {topic}/{partition}"))?;
        Ok(Arc::new(client))
    }
}

impl Driver for Kafka {
    fn name(&self) -> String {
        "kafka".to_string()
    }

    fn durability(&self) -> String {
        let fsync = std::env::var("ROTARY_PEER_FSYNC")
            .unwrap_or_else(|_| "broker fsync not stated".to_string());
        format!("{fsync}, acks=all, replication factor 1")
    }

    fn create_topic<'a>(
        &'a self,
        topic: &'a str,
        partitions: usize,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move {
            anyhow::ensure!(
                partitions > 0,
                "topic {topic:?} needs at least one partition"
            );
            let name = topic_name(topic);
            self.client
                .controller_client()?
                .create_topic(
                    name.clone(),
                    i32::try_from(partitions).context("too many partitions")?,
                    1,
                    CREATE_TOPIC_TIMEOUT_MS,
                )
                .await
                .with_context(|| format!("creating topic {name:?}"))?;
            Ok(())
        })
    }

    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>> {
        Box::pin(async move {
            let name = topic_name(topic);
            let topics = self.client.list_topics().await.context("listing topics")?;
            let partitions = topics
                .iter()
                .find(|t| t.name == name)
                .with_context(|| format!("topic {name:?} does not exist"))?
                .partitions
                .len();
            let mut producers = Vec::with_capacity(partitions);
            for partition in 0..partitions {
                let client = self.partition_client(&name, partition).await?;
                producers.push(Arc::new(
                    BatchProducerBuilder::new(client)
                        .with_linger(LINGER)
                        .with_compression(Compression::NoCompression)
                        .build(RecordAggregator::new(self.batch_bytes_max)),
                ));
            }
            Ok(Box::new(KafkaProducer {
                partitions: producers,
            }) as Box<dyn Producer>)
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
            let name = topic_name(topic);
            let mut tasks = TaskConsumer::new(Vec::with_capacity(partitions.len()));
            for partition in partitions {
                let client = self.partition_client(&name, partition).await?;
                let mut records = StreamConsumerBuilder::new(client, StartOffset::Earliest)
                    .with_max_wait_ms(FETCH_WAIT_MS)
                    .with_max_batch_size(FETCH_BYTES_MAX)
                    .build();
                let sink = sink.clone();
                let name = name.clone();
                tasks.push(tokio::spawn(async move {
                    while let Some(record) = records.next().await {
                        let (record, _high_watermark) =
                            record.with_context(|| format!("fetching {name}/{partition}"))?;
                        let payload = record.record.value.with_context(|| {
                            format!(
                                "record {} of {name}/{partition} has no value",
                                record.offset
                            )
                        })?;
                        sink(partition, &payload);
                    }
                    anyhow::bail!("the consumer of {name}/{partition} ended")
                }));
            }
            Ok(Box::new(tasks) as Box<dyn Consumer>)
        })
    }
}

/// The record's create time, which brokers use for time-based retention
/// only: the runner's own timestamp is in the payload.
fn create_time() -> anyhow::Result<DateTime<Utc>> {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .context("the clock is before 1970")?;
    let micros = i64::try_from(since_epoch.as_micros()).context("the clock is past 2262")?;
    DateTime::from_timestamp_micros(micros).context("the clock is out of chrono's range")
}

struct KafkaProducer {
    /// One batching producer per partition of the topic, by partition index.
    partitions: Vec<Arc<BatchProducer<RecordAggregator>>>,
}

impl Producer for KafkaProducer {
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>> {
        let producer = self.partitions.get(partition).cloned();
        let partitions = self.partitions.len();
        Box::pin(async move {
            let producer = producer.with_context(|| {
                format!("partition {partition} of a topic with {partitions} partitions")
            })?;
            let record = Record {
                key: None,
                value: Some(payload.to_vec()),
                headers: BTreeMap::new(),
                timestamp: create_time()?,
            };
            let offset = producer
                .produce(record)
                .await
                .with_context(|| format!("producing to partition {partition}"))?;
            anyhow::ensure!(
                offset >= 0,
                "the broker acknowledged a record at offset {offset}"
            );
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_keep_only_legal_characters() {
        assert_eq!(topic_name("omb/topic 0:a.b-c_d"), "omb_topic_0_a.b-c_d");
    }
}
