//! OpenMessaging Benchmark workload files: parsed as OMB writes them, with
//! OMB's defaults, and checked before anything is created.
//!
//! Integers are read as `i64` and numbers as `f64` so that a negative or
//! fractional value gets a message naming the field rather than serde's
//! "expected u32". Unknown fields are refused (a typo would otherwise
//! silently run a different workload).

use anyhow::Context as _;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Bytes the runner stamps at the start of every payload: the send time in
/// microseconds, little-endian. End-to-end latency is read back from them.
pub const TIMESTAMP_LEN: usize = 8;
/// Largest `topics`.
pub const TOPICS_MAX: i64 = 10_000;
/// Largest `topics × partitionsPerTopic`.
pub const PARTITIONS_TOTAL_MAX: i64 = 100_000;
/// Largest `messageSize`: 64 MiB.
pub const MESSAGE_SIZE_MAX: i64 = 64 << 20;
/// Largest `topics × producersPerTopic`, and of consumers in all.
pub const CLIENTS_TOTAL_MAX: i64 = 10_000;
/// Largest `subscriptionsPerTopic`.
pub const SUBSCRIPTIONS_MAX: i64 = 1_000;
/// Largest `producerRate`, messages per second.
pub const RATE_MAX: i64 = 10_000_000;
/// Longest test or warm-up: one day.
pub const DURATION_MINUTES_MAX: f64 = 24.0 * 60.0;
/// Memory the randomized payload pool may take.
pub const PAYLOAD_POOL_BYTES_MAX: u64 = 1 << 30;
/// Largest `consumerBacklogSizeGB`.
pub const BACKLOG_GB_MAX: f64 = 1024.0;
/// OMB's GB is 2^30 bytes.
pub const GB: f64 = (1u64 << 30) as f64;

/// How each message picks the partition it is sent to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum KeyDistributor {
    /// No key: partitions in turn (as OMB's drivers do for unkeyed sends).
    #[default]
    NoKey,
    /// A key per message from a round-robin sequence: partitions in turn.
    KeyRoundRobin,
    /// A random key per message: a random partition.
    RandomNano,
}

/// A workload file as written (OMB's field names).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct WorkloadFile {
    name: String,
    topics: i64,
    partitions_per_topic: i64,
    #[serde(default)]
    key_distributor: KeyDistributor,
    message_size: i64,
    #[serde(default)]
    use_randomized_payloads: bool,
    #[serde(default)]
    random_bytes_ratio: f64,
    #[serde(default)]
    randomized_payload_pool_size: i64,
    #[serde(default)]
    payload_file: Option<String>,
    subscriptions_per_topic: i64,
    consumer_per_subscription: i64,
    producers_per_topic: i64,
    producer_rate: i64,
    #[serde(default, rename = "consumerBacklogSizeGB")]
    consumer_backlog_size_gb: f64,
    #[serde(default = "default_drain_ratio")]
    backlog_drain_ratio: f64,
    test_duration_minutes: f64,
    #[serde(default = "default_warmup_minutes")]
    warmup_duration_minutes: f64,
}

fn default_drain_ratio() -> f64 {
    1.0
}

fn default_warmup_minutes() -> f64 {
    1.0
}

/// Where payloads come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Payloads {
    /// `payloadFile`, resolved, exactly `messageSize` bytes long.
    File(PathBuf),
    /// `randomizedPayloadPoolSize` payloads, each with the first
    /// `randomBytesRatio` of its bytes random and the rest zero.
    Random { pool_size: usize, random_ratio: f64 },
}

/// A checked workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub name: String,
    pub topics: usize,
    pub partitions_per_topic: usize,
    pub key_distributor: KeyDistributor,
    pub message_size: usize,
    pub payloads: Payloads,
    pub subscriptions_per_topic: usize,
    pub consumer_per_subscription: usize,
    pub producers_per_topic: usize,
    /// Aggregate messages per second; 0 = find the maximum sustainable rate.
    pub producer_rate: u64,
    /// Backlog to build before consumers start; 0 = consumers from the start.
    pub consumer_backlog_bytes: u64,
    pub backlog_drain_ratio: f64,
    pub test_duration: Duration,
    pub warmup_duration: Duration,
}

impl Workload {
    /// Reads and checks the workload at `path`. A relative `payloadFile`
    /// is looked for in the current directory (as OMB does), then beside
    /// the workload file.
    pub fn load(path: &Path) -> anyhow::Result<Workload> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading workload {}", path.display()))?;
        Workload::parse(&text, path.parent())
            .with_context(|| format!("workload {}", path.display()))
    }

    /// Parses and checks a workload; `dir` is the workload file's directory.
    pub fn parse(text: &str, dir: Option<&Path>) -> anyhow::Result<Workload> {
        let raw: WorkloadFile = serde_yaml::from_str(text)?;
        raw.check(dir)
    }

    /// Messages ever retained by the backlog, as OMB counts it.
    pub fn backlog_messages(&self) -> u64 {
        self.consumer_backlog_bytes / self.message_size as u64
    }

    pub fn partitions_total(&self) -> usize {
        self.topics * self.partitions_per_topic
    }

    pub fn producers_total(&self) -> usize {
        self.topics * self.producers_per_topic
    }

    pub fn consumers_per_topic(&self) -> usize {
        self.subscriptions_per_topic * self.consumer_per_subscription
    }
}

fn minutes(field: &str, m: f64, zero_ok: bool) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        m.is_finite() && m <= DURATION_MINUTES_MAX && (m > 0.0 || (zero_ok && m == 0.0)),
        "{field} must be {} {DURATION_MINUTES_MAX} minutes at most (fractions accepted), not {m}",
        if zero_ok {
            "0 or more and"
        } else {
            "more than 0 and"
        }
    );
    Ok(Duration::from_secs_f64(m * 60.0))
}

fn count(field: &str, v: i64, min: i64, max: i64) -> anyhow::Result<usize> {
    anyhow::ensure!(
        (min..=max).contains(&v),
        "{field} must be {min} to {max}, not {v}"
    );
    Ok(v as usize)
}

impl WorkloadFile {
    fn check(self, dir: Option<&Path>) -> anyhow::Result<Workload> {
        let topics = count("topics", self.topics, 1, TOPICS_MAX)?;
        let partitions_per_topic = count(
            "partitionsPerTopic",
            self.partitions_per_topic,
            1,
            PARTITIONS_TOTAL_MAX,
        )?;
        anyhow::ensure!(
            self.topics * self.partitions_per_topic <= PARTITIONS_TOTAL_MAX,
            "topics × partitionsPerTopic must be at most {PARTITIONS_TOTAL_MAX}, not {}",
            self.topics * self.partitions_per_topic
        );
        anyhow::ensure!(
            self.message_size >= TIMESTAMP_LEN as i64,
            "messageSize must be at least {TIMESTAMP_LEN} bytes (each payload starts with an \
             {TIMESTAMP_LEN}-byte send timestamp), not {}",
            self.message_size
        );
        let message_size = count("messageSize", self.message_size, 1, MESSAGE_SIZE_MAX)?;
        let producers_per_topic = count(
            "producersPerTopic",
            self.producers_per_topic,
            1,
            CLIENTS_TOTAL_MAX,
        )?;
        anyhow::ensure!(
            self.topics * self.producers_per_topic <= CLIENTS_TOTAL_MAX,
            "topics × producersPerTopic must be at most {CLIENTS_TOTAL_MAX}"
        );
        let subscriptions_per_topic = count(
            "subscriptionsPerTopic",
            self.subscriptions_per_topic,
            0,
            SUBSCRIPTIONS_MAX,
        )?;
        let consumer_per_subscription = count(
            "consumerPerSubscription",
            self.consumer_per_subscription,
            if subscriptions_per_topic > 0 { 1 } else { 0 },
            CLIENTS_TOTAL_MAX,
        )?;
        anyhow::ensure!(
            self.topics * self.subscriptions_per_topic * self.consumer_per_subscription
                <= CLIENTS_TOTAL_MAX,
            "topics × subscriptionsPerTopic × consumerPerSubscription must be at most \
             {CLIENTS_TOTAL_MAX}"
        );
        let producer_rate = count("producerRate", self.producer_rate, 0, RATE_MAX)? as u64;

        let payloads = self.payloads(message_size, dir)?;
        let consumer_backlog_bytes = self.backlog_bytes(subscriptions_per_topic, message_size)?;
        Ok(Workload {
            name: self.name,
            topics,
            partitions_per_topic,
            key_distributor: self.key_distributor,
            message_size,
            payloads,
            subscriptions_per_topic,
            consumer_per_subscription,
            producers_per_topic,
            producer_rate,
            consumer_backlog_bytes,
            backlog_drain_ratio: self.backlog_drain_ratio,
            test_duration: minutes("testDurationMinutes", self.test_duration_minutes, false)?,
            warmup_duration: minutes("warmupDurationMinutes", self.warmup_duration_minutes, true)?,
        })
    }

    /// The payloads: a random pool of them, or the payload file.
    fn payloads(&self, message_size: usize, dir: Option<&Path>) -> anyhow::Result<Payloads> {
        if self.use_randomized_payloads {
            anyhow::ensure!(
                (0.0..=1.0).contains(&self.random_bytes_ratio),
                "randomBytesRatio must be 0 to 1, not {}",
                self.random_bytes_ratio
            );
            let pool_size = count(
                "randomizedPayloadPoolSize",
                self.randomized_payload_pool_size,
                1,
                i64::MAX,
            )
            .context("useRandomizedPayloads needs a pool")?;
            let pool_bytes = (pool_size as u64).saturating_mul(message_size as u64);
            anyhow::ensure!(
                pool_bytes <= PAYLOAD_POOL_BYTES_MAX,
                "randomizedPayloadPoolSize × messageSize is {pool_bytes} bytes; at most \
                 {PAYLOAD_POOL_BYTES_MAX} are held in memory"
            );
            Ok(Payloads::Random {
                pool_size,
                random_ratio: self.random_bytes_ratio,
            })
        } else {
            let Some(file) = &self.payload_file else {
                anyhow::bail!("payloadFile is required unless useRandomizedPayloads is true");
            };
            let path = resolve(file, dir)?;
            let len = std::fs::metadata(&path)
                .with_context(|| format!("payloadFile {}", path.display()))?
                .len();
            anyhow::ensure!(
                len == message_size as u64,
                "payloadFile {} is {len} bytes, but messageSize is {message_size}",
                path.display()
            );
            Ok(Payloads::File(path))
        }
    }

    /// The backlog test's target in bytes (0: no backlog test), checked
    /// with the drain ratio.
    fn backlog_bytes(
        &self,
        subscriptions_per_topic: usize,
        message_size: usize,
    ) -> anyhow::Result<u64> {
        anyhow::ensure!(
            self.consumer_backlog_size_gb.is_finite()
                && (0.0..=BACKLOG_GB_MAX).contains(&self.consumer_backlog_size_gb),
            "consumerBacklogSizeGB must be 0 to {BACKLOG_GB_MAX}, not {}",
            self.consumer_backlog_size_gb
        );
        let consumer_backlog_bytes = (self.consumer_backlog_size_gb * GB) as u64;
        anyhow::ensure!(
            consumer_backlog_bytes == 0 || subscriptions_per_topic > 0,
            "consumerBacklogSizeGB needs subscriptionsPerTopic of 1 or more"
        );
        anyhow::ensure!(
            consumer_backlog_bytes == 0 || consumer_backlog_bytes >= message_size as u64,
            "consumerBacklogSizeGB is less than one message"
        );
        anyhow::ensure!(
            self.backlog_drain_ratio > 0.0 && self.backlog_drain_ratio <= 1.0,
            "backlogDrainRatio must be more than 0 and at most 1, not {}",
            self.backlog_drain_ratio
        );
        Ok(consumer_backlog_bytes)
    }
}

/// `payloadFile` as a path that exists: absolute, else relative to the
/// current directory, else to the workload's directory.
fn resolve(file: &str, dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = PathBuf::from(file);
    let mut tried = vec![path.clone()];
    if path.is_relative() {
        if let Some(d) = dir {
            tried.push(d.join(&path));
        }
    }
    for p in &tried {
        if p.is_file() {
            return Ok(p.clone());
        }
    }
    let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    anyhow::bail!(
        "payloadFile {file:?} not found (looked at {})",
        tried.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "name: t\ntopics: 1\npartitionsPerTopic: 2\nmessageSize: 64\n\
        useRandomizedPayloads: true\nrandomizedPayloadPoolSize: 4\nsubscriptionsPerTopic: 1\n\
        consumerPerSubscription: 1\nproducersPerTopic: 1\nproducerRate: 100\n\
        testDurationMinutes: 0.25\n";

    #[test]
    fn defaults_are_omb_defaults() {
        let w = Workload::parse(BASE, None).unwrap();
        assert_eq!(w.key_distributor, KeyDistributor::NoKey);
        assert_eq!(w.warmup_duration, Duration::from_secs(60));
        assert_eq!(w.test_duration, Duration::from_secs(15));
        assert_eq!(w.backlog_drain_ratio, 1.0);
        assert_eq!(w.consumer_backlog_bytes, 0);
        assert_eq!(
            w.payloads,
            Payloads::Random {
                pool_size: 4,
                random_ratio: 0.0
            }
        );
    }

    #[test]
    fn key_distributors_parse() {
        for (text, want) in [
            ("NO_KEY", KeyDistributor::NoKey),
            ("KEY_ROUND_ROBIN", KeyDistributor::KeyRoundRobin),
            ("RANDOM_NANO", KeyDistributor::RandomNano),
        ] {
            let w = Workload::parse(&format!("{BASE}keyDistributor: {text}\n"), None).unwrap();
            assert_eq!(w.key_distributor, want);
        }
    }

    #[test]
    fn backlog_gb_is_binary() {
        let w = Workload::parse(&format!("{BASE}consumerBacklogSizeGB: 0.5\n"), None).unwrap();
        assert_eq!(w.consumer_backlog_bytes, 1 << 29);
        assert_eq!(w.backlog_messages(), (1 << 29) / 64);
    }
}
