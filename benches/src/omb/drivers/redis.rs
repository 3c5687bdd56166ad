//! Redis Streams, driven through the `redis` crate on tokio.
//!
//! A partition is one stream key, `<topic>:<partition>`. A send is one
//! `XADD` with the payload as the single field `d`; its reply is the ack.
//! Sends take turns over [`PRODUCER_CONNECTIONS`] multiplexed connections,
//! each pipelining many at once. More than one matters with `appendfsync
//! always`: the server reads at most 16 KiB from a connection per
//! event-loop round and fsyncs once per round, so one connection caps how
//! many writes share an fsync (OpenMessaging's Redis driver also sends
//! from a pool of connections).
//! A consumer owns a connection of its own and loops on a blocking `XREAD`
//! over all of its partitions' keys, starting at id `0` and moving each
//! key's position past what it has read: every subscription reads
//! everything, independently, without consumer groups.
//!
//! With `appendonly yes` the reply to a write comes after it is in the
//! append-only file; with `appendfsync always` the file is also fsynced
//! (once per event-loop round, shared by every write of that round) before
//! the reply. [`Driver::durability`] states what the server says its
//! settings are.

use crate::omb::driver::{BoxFuture, Consumer, Driver, MessageSink, Producer, TaskConsumer};
use anyhow::Context as _;
use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamReadOptions, StreamReadReply};
use redis::{AsyncCommands, AsyncConnectionConfig, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a command may wait for its reply. Generous: with `appendfsync
/// always` a reply waits for an fsync, and the machine may be loaded.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one blocking `XREAD` waits for new entries before it is sent
/// again; bounds how long a closed consumer's last read lingers.
const READ_BLOCK_MS: usize = 100;
/// Entries one `XREAD` returns per key at most.
const READ_COUNT_MAX: usize = 1_024;
/// The stream entry field that carries the payload.
const FIELD: &str = "d";
/// Connections the producers of one driver send over, in turn.
const PRODUCER_CONNECTIONS: usize = 4;

/// A connection to one Redis server.
pub struct Redis {
    client: redis::Client,
    producers: Arc<[MultiplexedConnection]>,
    durability: String,
}

fn connection_config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT))
}

/// Connects to the Redis server at `endpoint` (`HOST:PORT`) and asks it for
/// its persistence and replication settings.
pub async fn connect(endpoint: &str) -> anyhow::Result<Box<dyn Driver>> {
    let client = redis::Client::open(format!("redis://{endpoint}/"))
        .with_context(|| format!("parsing the Redis address {endpoint:?}"))?;
    let mut producers = Vec::with_capacity(PRODUCER_CONNECTIONS);
    for _ in 0..PRODUCER_CONNECTIONS {
        producers.push(
            client
                .get_multiplexed_async_connection_with_config(&connection_config())
                .await
                .with_context(|| format!("connecting to redis-server at {endpoint}"))?,
        );
    }
    let durability = describe_durability(&mut producers[0]).await?;
    let producers: Arc<[MultiplexedConnection]> = producers.into();
    Ok(Box::new(Redis {
        client,
        producers,
        durability,
    }))
}

/// The server's own word on what a write's reply means, e.g.
/// `redis 7.0.15: AOF, appendfsync always, replication 1 (no replicas)`.
async fn describe_durability(connection: &mut MultiplexedConnection) -> anyhow::Result<String> {
    let config: HashMap<String, String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendonly")
        .arg("appendfsync")
        .query_async(connection)
        .await
        .context("asking redis-server for its persistence settings")?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .arg("replication")
        .query_async(connection)
        .await
        .context("asking redis-server for its version and replicas")?;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or("?")
            .trim()
            .to_string()
    };
    let persistence = match config.get("appendonly").map(String::as_str) {
        Some("yes") => format!(
            "AOF, appendfsync {}",
            config.get("appendfsync").map_or("?", String::as_str)
        ),
        _ => "no AOF (ack from memory)".to_string(),
    };
    let replicas = field("connected_slaves");
    Ok(format!(
        "redis {}: {persistence}, replication 1 ({replicas} replicas, no WAIT)",
        field("redis_version")
    ))
}

fn stream_key(topic: &str, partition: usize) -> String {
    format!("{topic}:{partition}")
}

impl Driver for Redis {
    fn name(&self) -> String {
        "redis".to_string()
    }

    fn durability(&self) -> String {
        self.durability.clone()
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
            // Streams come into being with their first XADD; removing any
            // left from an earlier run keeps the topic fresh.
            let keys: Vec<String> = (0..partitions).map(|p| stream_key(topic, p)).collect();
            let mut connection = self.producers[0].clone();
            let _: usize = connection
                .del(&keys)
                .await
                .with_context(|| format!("removing old streams of topic {topic:?}"))?;
            Ok(())
        })
    }

    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>> {
        Box::pin(async move {
            Ok(Box::new(RedisProducer {
                connections: self.producers.clone(),
                next: AtomicUsize::new(0),
                topic: topic.to_string(),
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
            anyhow::ensure!(!partitions.is_empty(), "a consumer needs a partition");
            // A blocking XREAD holds its connection until it returns, so a
            // consumer never shares the producers' connections.
            let connection = self
                .client
                .get_multiplexed_async_connection_with_config(&connection_config())
                .await
                .context("connecting a consumer to redis-server")?;
            let task = tokio::spawn(read_loop(connection, topic.to_string(), partitions, sink));
            Ok(Box::new(TaskConsumer::new(vec![task])) as Box<dyn Consumer>)
        })
    }
}

/// Reads `partitions` of `topic` from their first entry until aborted.
async fn read_loop(
    mut connection: MultiplexedConnection,
    topic: String,
    partitions: Vec<usize>,
    sink: MessageSink,
) -> anyhow::Result<()> {
    let keys: Vec<String> = partitions.iter().map(|&p| stream_key(&topic, p)).collect();
    let mut positions: Vec<String> = vec!["0".to_string(); keys.len()];
    let options = StreamReadOptions::default()
        .block(READ_BLOCK_MS)
        .count(READ_COUNT_MAX);
    loop {
        let reply: Option<StreamReadReply> = connection
            .xread_options(&keys, &positions, &options)
            .await
            .with_context(|| format!("reading streams of topic {topic:?}"))?;
        let Some(reply) = reply else { continue };
        for stream in reply.keys {
            let index = keys
                .iter()
                .position(|key| *key == stream.key)
                .with_context(|| {
                    format!("XREAD answered for a key not asked for: {}", stream.key)
                })?;
            let partition = partitions[index];
            for entry in stream.ids {
                match entry.map.get(FIELD) {
                    Some(Value::BulkString(payload)) => sink(partition, payload),
                    other => anyhow::bail!(
                        "entry {} of {} has no payload field {FIELD:?}: {other:?}",
                        entry.id,
                        stream.key
                    ),
                }
                positions[index] = entry.id;
            }
        }
    }
}

struct RedisProducer {
    connections: Arc<[MultiplexedConnection]>,
    /// The connection of the next send, modulo their number.
    next: AtomicUsize,
    topic: String,
}

impl Producer for RedisProducer {
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let mut connection = self.connections[turn].clone();
        let key = stream_key(&self.topic, partition);
        Box::pin(async move {
            let _id: String = redis::cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg(FIELD)
                .arg(payload.as_ref())
                .query_async(&mut connection)
                .await
                .with_context(|| format!("XADD to {key}"))?;
            Ok(())
        })
    }
}
