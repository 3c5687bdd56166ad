//! NATS JetStream, driven through `async-nats`.
//!
//! A topic is one stream with file storage and one replica whose subjects
//! are `<topic>.<partition>`. A send publishes to the partition's subject
//! and resolves on the stream's publish ack. A consumer is one ordered pull
//! consumer per partition (server 2.9 filters a consumer on one subject
//! only) delivering from the stream's first message (`DeliverPolicy::All`);
//! ordered consumers are ephemeral and take no acks, so every subscription
//! reads independently.
//!
//! What a publish ack means on disk is the server's setting, not the
//! client's: `nats-server` 2.9 acks once the message is in its file store's
//! buffers and fsyncs on a timer (2 minutes by default; `sync_interval:
//! always` exists from 2.10 on). The script that starts the server says
//! which it chose in `ROTARY_PEER_FSYNC`; [`Driver::durability`] repeats it.

use crate::omb::driver::{BoxFuture, Consumer, Driver, MessageSink, Producer, TaskConsumer};
use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures_util::StreamExt;
use std::time::Duration;

/// How long a publish or a JetStream API request may wait for its reply.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Publishes whose acks may be outstanding at once on one connection; a
/// publish past it waits (backpressure) instead of failing.
const ACKS_INFLIGHT_MAX: usize = 16_384;
/// Messages one pull request of a consumer asks for.
const PULL_BATCH_MAX: i64 = 1_024;
/// Largest payload a stream accepts; the server's `max_payload` must be at
/// least this (the peers script sets 8 MiB) for the 1 MiB workloads.
const MESSAGE_BYTES_MAX: i32 = 8 << 20;

/// A connection to one `nats-server` with JetStream enabled.
pub struct Nats {
    jetstream: jetstream::Context,
    server_version: String,
}

/// Connects to the NATS server at `endpoint` (`HOST:PORT`).
pub async fn connect(endpoint: &str) -> anyhow::Result<Box<dyn Driver>> {
    let client = async_nats::ConnectOptions::new()
        .name("rotary-bench")
        .request_timeout(Some(REQUEST_TIMEOUT))
        .connect(endpoint)
        .await
        .with_context(|| format!("connecting to nats-server at {endpoint}"))?;
    let server_version = client.server_info().version;
    let jetstream = jetstream::ContextBuilder::new()
        .timeout(REQUEST_TIMEOUT)
        .max_ack_inflight(ACKS_INFLIGHT_MAX)
        .backpressure_on_inflight(true)
        .build(client);
    Ok(Box::new(Nats {
        jetstream,
        server_version,
    }))
}

/// A stream name and subject token from a topic name: NATS allows neither
/// `.`, `*`, `>` nor whitespace in them.
fn stream_name(topic: &str) -> String {
    topic
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn subject(stream: &str, partition: usize) -> String {
    format!("{stream}.{partition}")
}

impl Driver for Nats {
    fn name(&self) -> String {
        "nats".to_string()
    }

    fn durability(&self) -> String {
        let fsync = std::env::var("ROTARY_PEER_FSYNC")
            .unwrap_or_else(|_| "fsync as the server is configured (not stated)".to_string());
        format!(
            "nats-server {}: JetStream file storage, {fsync}, replication 1",
            self.server_version
        )
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
            let name = stream_name(topic);
            self.jetstream
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![format!("{name}.*")],
                    storage: stream::StorageType::File,
                    num_replicas: 1,
                    max_message_size: MESSAGE_BYTES_MAX,
                    ..Default::default()
                })
                .await
                .with_context(|| format!("creating JetStream stream {name:?}"))?;
            Ok(())
        })
    }

    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>> {
        Box::pin(async move {
            Ok(Box::new(NatsProducer {
                jetstream: self.jetstream.clone(),
                stream: stream_name(topic),
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
            let name = stream_name(topic);
            let stream = self
                .jetstream
                .get_stream(&name)
                .await
                .with_context(|| format!("looking up JetStream stream {name:?}"))?;
            let mut tasks = TaskConsumer::new(Vec::with_capacity(partitions.len()));
            for partition in partitions {
                let filter_subject = subject(&name, partition);
                let messages = stream
                    .create_consumer(consumer::pull::OrderedConfig {
                        filter_subject: filter_subject.clone(),
                        deliver_policy: consumer::DeliverPolicy::All,
                        max_batch: PULL_BATCH_MAX,
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("creating a consumer of {filter_subject:?}"))?
                    .messages()
                    .await
                    .with_context(|| format!("pulling from {filter_subject:?}"))?;
                let sink = sink.clone();
                tasks.push(tokio::spawn(async move {
                    let mut messages = messages;
                    while let Some(message) = messages.next().await {
                        let message = message
                            .with_context(|| format!("receiving from {filter_subject:?}"))?;
                        sink(partition, &message.payload);
                    }
                    anyhow::bail!("the consumer of {filter_subject:?} ended")
                }));
            }
            Ok(Box::new(tasks) as Box<dyn Consumer>)
        })
    }
}

struct NatsProducer {
    jetstream: jetstream::Context,
    stream: String,
}

impl Producer for NatsProducer {
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>> {
        let jetstream = self.jetstream.clone();
        let subject = subject(&self.stream, partition);
        Box::pin(async move {
            let ack = jetstream
                .publish(subject, payload)
                .await
                .context("publishing")?
                .await
                .context("waiting for the publish ack")?;
            anyhow::ensure!(
                !ack.duplicate,
                "the server dropped a publish as a duplicate"
            );
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_names_have_no_subject_separators() {
        assert_eq!(stream_name("topic-0.a b*>"), "topic-0_a_b__");
        assert_eq!(subject(&stream_name("t.1"), 3), "t_1.3");
    }
}
