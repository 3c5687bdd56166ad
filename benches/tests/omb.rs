//! `rotary bench --workload`: workload files, runs against a broker started
//! here on loopback (and against an in-memory driver that can lose or
//! duplicate messages), the result JSON and the charts.

use bytes::Bytes;
use rotary_benches::omb::chart;
use rotary_benches::omb::driver::{BoxFuture, Consumer, Driver, MessageSink, Producer};
use rotary_benches::omb::drivers::rotary::{RotaryDriver, RotaryOptions};
use rotary_benches::omb::{run, Options, TestResult, Workload};
use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::Durability;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn workloads_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads")
}

/// A valid workload; tests replace or add lines.
const BASE: &str = "\
name: base
topics: 1
partitionsPerTopic: 2
messageSize: 64
useRandomizedPayloads: true
randomizedPayloadPoolSize: 4
subscriptionsPerTopic: 1
consumerPerSubscription: 1
producersPerTopic: 1
producerRate: 100
testDurationMinutes: 1
";

/// `BASE` with the line of `field` replaced by `line` (or `line` added).
fn with(field: &str, line: &str) -> String {
    let mut out: Vec<String> = BASE
        .lines()
        .filter(|l| !l.starts_with(&format!("{field}:")))
        .map(str::to_string)
        .collect();
    out.push(line.to_string());
    out.join("\n") + "\n"
}

fn parse_error(text: &str, dir: Option<&Path>) -> String {
    match Workload::parse(text, dir) {
        Ok(w) => panic!("accepted: {w:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn every_shipped_workload_parses() {
    let mut names = Vec::new();
    let mut seen_max_rate = false;
    let mut seen_backlog = false;
    let mut seen_100_journals = false;
    let mut seen_1k_fixed = false;
    for entry in std::fs::read_dir(workloads_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let w = Workload::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        assert_eq!(
            path.file_stem().unwrap().to_str().unwrap(),
            w.name,
            "file named after its workload"
        );
        seen_max_rate |= w.producer_rate == 0 && w.message_size == 1 << 20;
        seen_backlog |= w.consumer_backlog_bytes > 0;
        seen_100_journals |= w.partitions_total() == 100;
        seen_1k_fixed |= w.producer_rate > 0 && w.message_size == 1024;
        names.push(w.name);
    }
    assert!(names.len() >= 4, "{names:?}");
    assert!(seen_max_rate && seen_backlog && seen_100_journals && seen_1k_fixed);
}

#[test]
fn an_unknown_field_is_refused_by_name() {
    let e = parse_error(&with("partitionPerTopic", "partitionPerTopic: 3"), None);
    assert!(e.contains("unknown field `partitionPerTopic`"), "{e}");
    let e = parse_error(&BASE.replace("messageSize: 64\n", ""), None);
    assert!(e.contains("missing field `messageSize`"), "{e}");
}

#[test]
fn bad_values_are_refused_with_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("short.data"), [0u8; 10]).unwrap();
    std::fs::write(dir.path().join("right.data"), [0u8; 64]).unwrap();
    let cases = [
        ("topics", "topics: 0", "topics must be 1 to"),
        (
            "partitionsPerTopic",
            "partitionsPerTopic: 0",
            "partitionsPerTopic must be 1 to",
        ),
        (
            "messageSize",
            "messageSize: 7",
            "messageSize must be at least 8 bytes",
        ),
        (
            "testDurationMinutes",
            "testDurationMinutes: -1",
            "testDurationMinutes must be more than 0",
        ),
        (
            "testDurationMinutes",
            "testDurationMinutes: 0",
            "testDurationMinutes must be more than 0",
        ),
        (
            "warmupDurationMinutes",
            "warmupDurationMinutes: -0.5",
            "warmupDurationMinutes must be 0 or more",
        ),
        (
            "producerRate",
            "producerRate: -5",
            "producerRate must be 0 to",
        ),
        (
            "producersPerTopic",
            "producersPerTopic: 0",
            "producersPerTopic must be 1 to",
        ),
        (
            "consumerPerSubscription",
            "consumerPerSubscription: 0",
            "consumerPerSubscription must be 1 to",
        ),
        (
            "randomBytesRatio",
            "randomBytesRatio: 1.5",
            "randomBytesRatio must be 0 to 1",
        ),
        (
            "randomizedPayloadPoolSize",
            "randomizedPayloadPoolSize: 0",
            "randomizedPayloadPoolSize must be 1 to",
        ),
        (
            "consumerBacklogSizeGB",
            "consumerBacklogSizeGB: -1",
            "consumerBacklogSizeGB must be 0 to",
        ),
        (
            "backlogDrainRatio",
            "backlogDrainRatio: 0",
            "backlogDrainRatio must be more than 0",
        ),
        (
            "keyDistributor",
            "keyDistributor: ROUND_ROBIN",
            "unknown variant `ROUND_ROBIN`",
        ),
    ];
    for (field, line, want) in cases {
        let e = parse_error(&with(field, line), Some(dir.path()));
        assert!(e.contains(want), "{line}: {e}");
    }
    // Payload files: absent, missing, wrong size, right size.
    let file_based = |line: &str| {
        with("useRandomizedPayloads", "useRandomizedPayloads: false")
            + if line.is_empty() { "" } else { line }
            + "\n"
    };
    let e = parse_error(&file_based(""), Some(dir.path()));
    assert!(e.contains("payloadFile is required"), "{e}");
    let e = parse_error(&file_based("payloadFile: nowhere.data"), Some(dir.path()));
    assert!(e.contains("payloadFile \"nowhere.data\" not found"), "{e}");
    let e = parse_error(&file_based("payloadFile: short.data"), Some(dir.path()));
    assert!(e.contains("is 10 bytes, but messageSize is 64"), "{e}");
    let w = Workload::parse(&file_based("payloadFile: right.data"), Some(dir.path())).unwrap();
    assert_eq!(w.message_size, 64);
    // Fractional minutes are accepted.
    let w = Workload::parse(
        &with("testDurationMinutes", "testDurationMinutes: 0.25"),
        None,
    )
    .unwrap();
    assert_eq!(w.test_duration, Duration::from_secs(15));
}

/// A broker on loopback in a temporary directory, stopped on drop.
struct TestBroker {
    broker: Option<Broker>,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl TestBroker {
    fn start(local_cache_bytes: u64) -> (TestBroker, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ServeConfig::new(dir.path().join("data"), "127.0.0.1:0".parse().unwrap());
        config.cores = 2;
        config.local_cache_bytes = local_cache_bytes;
        let broker = Broker::start(config).unwrap();
        let endpoint = broker.endpoints[0].to_string();
        let store = dir.path().join("store");
        std::fs::create_dir_all(&store).unwrap();
        (
            TestBroker {
                broker: Some(broker),
                endpoint,
                _dir: dir,
            },
            store,
        )
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(b) = self.broker.take() {
            b.shutdown();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn quiet(period_ms: u64) -> Options {
    Options {
        period: Duration::from_millis(period_ms),
        progress: false,
        stall_timeout: Duration::from_secs(10),
    }
}

fn run_rotary(broker: &TestBroker, w: &Workload, options: RotaryOptions) -> TestResult {
    let rt = runtime();
    let result = rt.block_on(async {
        let driver = RotaryDriver::connect(&broker.endpoint, w.message_size, options)
            .await
            .unwrap();
        run::run(&driver, w, &quiet(500)).await.unwrap()
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

/// Every field name OMB's result JSON has.
fn omb_field_names() -> Vec<String> {
    let mut names: Vec<String> = [
        "workload",
        "driver",
        "messageSize",
        "topics",
        "partitions",
        "producersPerTopic",
        "consumersPerTopic",
        "publishRate",
        "publishErrorRate",
        "consumeRate",
        "backlog",
        "aggregatedPublishLatencyQuantiles",
        "aggregatedPublishDelayLatencyQuantiles",
        "aggregatedEndToEndLatencyQuantiles",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for prefix in [
        "publishLatency",
        "publishDelayLatency",
        "endToEndLatency",
        "aggregatedPublishLatency",
        "aggregatedPublishDelayLatency",
        "aggregatedEndToEndLatency",
    ] {
        for suffix in [
            "Avg", "50pct", "75pct", "95pct", "99pct", "999pct", "9999pct", "Max",
        ] {
            names.push(format!("{prefix}{suffix}"));
        }
    }
    names
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn assert_delivered_exactly(json: &Value, subscriptions: u64) {
    assert_eq!(
        json["problems"],
        serde_json::json!([]),
        "{}",
        json["problems"]
    );
    assert_eq!(json["publishErrors"], 0);
    let sent = json["messagesSent"].as_u64().unwrap();
    assert!(sent > 0);
    assert_eq!(
        json["messagesReceived"].as_u64().unwrap(),
        subscriptions * sent
    );
    assert_eq!(json["finalBacklog"], 0);
    assert_eq!(json["deliveryMismatches"], serde_json::json!([]));
}

#[test]
fn a_tiny_workload_reaches_every_subscription_exactly() {
    let (broker, _) = TestBroker::start(4 << 30);
    let w = Workload::parse(
        "name: tiny\ntopics: 2\npartitionsPerTopic: 2\nmessageSize: 100\n\
         useRandomizedPayloads: true\nrandomBytesRatio: 0.5\nrandomizedPayloadPoolSize: 16\n\
         subscriptionsPerTopic: 2\nconsumerPerSubscription: 1\nproducersPerTopic: 1\n\
         keyDistributor: RANDOM_NANO\nproducerRate: 300\n\
         testDurationMinutes: 0.05\nwarmupDurationMinutes: 0.01\n",
        None,
    )
    .unwrap();
    let result = run_rotary(&broker, &w, RotaryOptions::default());
    let json = result.to_json();
    assert_delivered_exactly(&json, 2);

    // OMB's header and every OMB field name, with OMB's units.
    for name in omb_field_names() {
        assert!(json.get(&name).is_some(), "result lacks {name}");
    }
    assert_eq!(json["workload"], "tiny");
    assert_eq!(json["driver"], "rotary");
    assert_eq!(json["messageSize"], 100);
    assert_eq!(json["topics"], 2);
    assert_eq!(json["partitions"], 2);
    assert_eq!(json["consumersPerTopic"], 2);
    assert!(json["durability"].as_str().unwrap().contains("replicated"));
    let periods = numbers(&json["publishRate"]).len();
    assert!(periods >= 1);
    for key in [
        "publishErrorRate",
        "consumeRate",
        "backlog",
        "publishLatency99pct",
        "publishDelayLatencyMax",
        "endToEndLatencyAvg",
    ] {
        assert_eq!(numbers(&json[key]).len(), periods, "{key}");
    }
    for key in [
        "aggregatedPublishLatencyQuantiles",
        "aggregatedPublishDelayLatencyQuantiles",
        "aggregatedEndToEndLatencyQuantiles",
    ] {
        let m = json[key].as_object().unwrap();
        for p in ["1.0", "50.0", "99.0", "99.9", "99.99", "100.0"] {
            assert!(m.contains_key(p), "{key} lacks {p}");
        }
        let mut points: Vec<(f64, f64)> = m
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.as_f64().unwrap()))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(points.iter().all(|(_, v)| *v >= 0.0), "{key}");
        assert!(
            points.windows(2).all(|p| p[0].1 <= p[1].1),
            "{key} not monotonic"
        );
    }
    // Every message was received, so end-to-end latency was recorded, and
    // none is negative; max is the 100th percentile.
    assert!(json["aggregatedEndToEndLatencyMax"].as_f64().unwrap() > 0.0);
    assert!(numbers(&json["endToEndLatencyMax"])
        .iter()
        .all(|v| *v >= 0.0));
    assert_eq!(
        json["aggregatedEndToEndLatencyMax"],
        json["aggregatedEndToEndLatencyQuantiles"]["100.0"]
    );
    // Publish delay is whole microseconds.
    assert!(json["aggregatedPublishDelayLatency99pct"].is_u64());

    // The written text keeps OMB's order, quantiles in numeric order.
    let text = result.to_json_pretty();
    assert!(text.find("\"workload\"").unwrap() < text.find("\"publishRate\"").unwrap());
    let q = text.find("\"aggregatedPublishLatencyQuantiles\"").unwrap();
    let tail = &text[q..];
    assert!(tail.find("\"2.0\"").unwrap() < tail.find("\"10.0\"").unwrap());

    // Charts of this result are SVG with a line per series.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.json");
    std::fs::write(&path, &text).unwrap();
    let results = chart::load_results(&[path]).unwrap();
    let written = chart::write(&results, dir.path()).unwrap();
    assert_eq!(written.len(), 3);
    for p in &written {
        let svg = std::fs::read_to_string(p).unwrap();
        assert!(svg.starts_with("<svg"), "{}", p.display());
        assert!(svg.trim_end().ends_with("</svg>"));
        let lines = svg.matches("<polyline").count();
        let want = if p.ends_with("throughput.svg") { 2 } else { 1 };
        assert_eq!(lines, want, "{}", p.display());
        // Every series has points.
        assert!(!svg.contains("points=\"\""), "{}", p.display());
    }
}

#[test]
fn held_back_consumers_drain_a_sealed_and_uploaded_backlog() {
    // Uploaded fragments leave the broker's disk: the catch-up reads the
    // store. The journals fdatasync before each ack.
    let (broker, store) = TestBroker::start(0);
    // 4 MiB of backlog in 4 KiB messages.
    let w = Workload::parse(
        "name: backlog\ntopics: 1\npartitionsPerTopic: 2\nmessageSize: 4096\n\
         useRandomizedPayloads: true\nrandomBytesRatio: 0.5\nrandomizedPayloadPoolSize: 8\n\
         subscriptionsPerTopic: 1\nconsumerPerSubscription: 2\nproducersPerTopic: 1\n\
         producerRate: 2000\nconsumerBacklogSizeGB: 0.00390625\nbacklogDrainRatio: 1.0\n\
         testDurationMinutes: 0.02\nwarmupDurationMinutes: 0\n",
        None,
    )
    .unwrap();
    assert_eq!(w.consumer_backlog_bytes, 4 << 20);
    let options = RotaryOptions {
        store: Some(format!("file://{}/", store.display())),
        fragment_length: Some(256 << 10),
        durability: Durability::Fsync,
    };
    let result = run_rotary(&broker, &w, options);
    let json = result.to_json();
    assert_delivered_exactly(&json, 1);
    let drain = &json["backlogDrain"];
    assert_eq!(drain["completed"], true, "{drain}");
    assert!(drain["builtBytes"].as_u64().unwrap() >= 4 << 20, "{drain}");
    // Consumers started late, at the beginning: they drained at least the
    // whole backlog.
    assert!(
        drain["drainedMessages"].as_u64().unwrap() >= w.backlog_messages(),
        "{drain}"
    );
    let durability = json["durability"].as_str().unwrap();
    assert!(durability.contains("file://"), "{durability}");
    assert!(durability.starts_with("fsync"), "{durability}");
    // The journals uploaded fragments to the store.
    let mut objects = 0;
    let mut stack = vec![store];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                objects += 1;
            }
        }
    }
    assert!(objects > 0, "no fragment reached the store");
}

/// The consumers of a [`MemDriver`]: topic, partitions, sink.
type MemConsumers = Arc<Mutex<Vec<(String, Vec<usize>, MessageSink)>>>;

/// An in-memory system: each send is handed straight to the sinks of the
/// consumers reading its partition, `copies` times (0 loses it, 2
/// duplicates it).
struct MemDriver {
    copies: usize,
    consumers: MemConsumers,
}

struct MemProducer {
    topic: String,
    copies: usize,
    consumers: MemConsumers,
}

struct MemConsumer;

impl Driver for MemDriver {
    fn name(&self) -> String {
        "memory".into()
    }

    fn durability(&self) -> String {
        "none (in memory)".into()
    }

    fn create_topic<'a>(&'a self, _: &'a str, _: usize) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn create_producer<'a>(
        &'a self,
        topic: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Producer>>> {
        Box::pin(async move {
            let p: Box<dyn Producer> = Box::new(MemProducer {
                topic: topic.to_string(),
                copies: self.copies,
                consumers: self.consumers.clone(),
            });
            Ok(p)
        })
    }

    fn create_consumer<'a>(
        &'a self,
        topic: &'a str,
        _: &'a str,
        partitions: Vec<usize>,
        sink: MessageSink,
    ) -> BoxFuture<'a, anyhow::Result<Box<dyn Consumer>>> {
        Box::pin(async move {
            self.consumers
                .lock()
                .unwrap()
                .push((topic.to_string(), partitions, sink));
            let c: Box<dyn Consumer> = Box::new(MemConsumer);
            Ok(c)
        })
    }
}

impl Producer for MemProducer {
    fn send(&self, partition: usize, payload: Bytes) -> BoxFuture<'static, anyhow::Result<()>> {
        let sinks: Vec<MessageSink> = self
            .consumers
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, ps, _)| *t == self.topic && ps.contains(&partition))
            .map(|(_, _, s)| s.clone())
            .collect();
        let copies = self.copies;
        Box::pin(async move {
            for s in sinks {
                for _ in 0..copies {
                    s(partition, &payload);
                }
            }
            Ok(())
        })
    }
}

impl Consumer for MemConsumer {
    fn close(self: Box<Self>) -> BoxFuture<'static, anyhow::Result<()>> {
        Box::pin(async { Ok(()) })
    }
}

fn run_mem(copies: usize, text: &str) -> TestResult {
    let w = Workload::parse(text, None).unwrap();
    let driver = MemDriver {
        copies,
        consumers: Arc::default(),
    };
    let rt = runtime();
    let result = rt.block_on(run::run(&driver, &w, &quiet(200))).unwrap();
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

const MEM: &str = "name: mem\ntopics: 2\npartitionsPerTopic: 3\nmessageSize: 32\n\
    useRandomizedPayloads: true\nrandomizedPayloadPoolSize: 2\nsubscriptionsPerTopic: 2\n\
    consumerPerSubscription: 2\nproducersPerTopic: 2\nproducerRate: 500\n\
    testDurationMinutes: 0.01\nwarmupDurationMinutes: 0\n";

#[test]
fn a_system_that_delivers_nothing_fails_the_run_with_a_clear_message() {
    let result = run_mem(0, MEM);
    assert!(
        result
            .problems
            .iter()
            .any(|p| p.starts_with("nothing was consumed: 8 consumer(s) received no message")),
        "{:?}",
        result.problems
    );
}

#[test]
fn lost_or_duplicated_messages_are_reported_per_partition() {
    let result = run_mem(2, MEM);
    let json = result.to_json();
    let mismatches = json["deliveryMismatches"].as_array().unwrap();
    // Every (topic, subscription, partition) that had a message got it twice.
    assert!(!mismatches.is_empty());
    assert!(mismatches[0]
        .as_str()
        .unwrap()
        .contains("subscription sub-"));
    assert!(
        result
            .problems
            .iter()
            .any(|p| p.contains("did not receive exactly what was acknowledged")),
        "{:?}",
        result.problems
    );
}

#[test]
fn the_maximum_rate_search_delivers_exactly() {
    let result = run_mem(1, &MEM.replace("producerRate: 500", "producerRate: 0"));
    let json = result.to_json();
    assert_delivered_exactly(&json, 2);
    assert!(json["maxRateFinal"].as_f64().unwrap() >= 10.0);
}

#[test]
fn several_results_share_one_chart() {
    let dir = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for name in ["a", "b", "c"] {
        let result = run_mem(1, MEM);
        let p = dir.path().join(format!("{name}.json"));
        std::fs::write(&p, result.to_json_pretty()).unwrap();
        paths.push(p);
    }
    let results = chart::load_results(&paths).unwrap();
    // Same driver and workload: the file names tell them apart.
    let labels: Vec<&str> = results.iter().map(|r| r.label.as_str()).collect();
    assert_eq!(
        labels,
        ["memory · mem (a)", "memory · mem (b)", "memory · mem (c)"]
    );
    let out = dir.path().join("charts");
    for p in chart::write(&results, &out).unwrap() {
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg"));
        let want = if p.ends_with("throughput.svg") { 6 } else { 3 };
        assert_eq!(svg.matches("<polyline").count(), want, "{}", p.display());
        for l in &labels {
            assert!(svg.contains(&format!(">{l}")), "{} lacks {l}", p.display());
        }
    }
    // Not a result: refused by name.
    let bogus = dir.path().join("bogus.json");
    std::fs::write(&bogus, "{\"x\": 1}").unwrap();
    let e = chart::load_results(&[bogus]).err().unwrap();
    assert!(
        format!("{e:#}").contains("not an OpenMessaging result"),
        "{e:#}"
    );
}
