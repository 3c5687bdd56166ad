//! The peer drivers against real servers: each test starts its server
//! (`nats-server`, `redis-server`, `tansu`) on 127.0.0.1 with a data
//! directory of its own, sends messages (one of 1 MiB) through the driver's
//! producer, checks that a subscription reading during the sends and one
//! created after them both receive exactly the payloads sent, byte for
//! byte, in the same order per partition, then stops the server by its PID.
//!
//! The servers are not part of the build, so the tests are ignored by
//! default; `benches/peers/run.sh` installs them. Run with
//! `cargo test -p rotary-benches --test peers -- --ignored`.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

use bytes::Bytes;
use futures_util::future::join_all;
use rotary_benches::omb::driver::{Driver, MessageSink};
use rotary_benches::omb::drivers;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PARTITIONS: usize = 3;
const MESSAGES: usize = 200;
const SENDS_INFLIGHT_MAX: usize = 16;
/// How long a server may take to listen, and the consumers to catch up.
const WAIT_MAX: Duration = Duration::from_secs(30);

/// A server process, killed by its PID when dropped.
struct Server {
    child: Child,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    listener.local_addr().expect("local address").port()
}

/// Starts `command` and waits until its port accepts connections.
fn start(mut command: Command, port: u16, dir: tempfile::TempDir) -> Server {
    let program = command.get_program().to_string_lossy().into_owned();
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("starting {program} (install it with benches/peers/run.sh): {e}")
        });
    let server = Server {
        child,
        endpoint: format!("127.0.0.1:{port}"),
        _dir: dir,
    };
    let started = Instant::now();
    while TcpStream::connect(&server.endpoint).is_err() {
        assert!(
            started.elapsed() < WAIT_MAX,
            "{program} did not listen on {}",
            server.endpoint
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

fn start_nats() -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let config = dir.path().join("nats.conf");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{port}\nmax_payload: 8MB\njetstream {{\n  store_dir: {:?}\n}}\n",
            dir.path().join("jetstream")
        ),
    )
    .expect("writing nats.conf");
    let mut command = Command::new("nats-server");
    command.arg("-c").arg(&config);
    start(command, port, dir)
}

fn start_redis() -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let mut command = Command::new("redis-server");
    command
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ])
        .arg("--dir")
        .arg(dir.path());
    start(command, port, dir)
}

fn start_tansu() -> Server {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let listener = format!("tcp://127.0.0.1:{port}");
    let mut command = Command::new(tansu_binary());
    command
        .arg("broker")
        .args(["--kafka-listener-url", &listener])
        .args(["--kafka-advertised-listener-url", &listener])
        .args(["--storage-engine", "memory://tansu/"])
        .arg("--silent")
        .current_dir(dir.path());
    start(command, port, dir)
}

/// `tansu` from PATH, or where `cargo install` puts it.
fn tansu_binary() -> String {
    let installed = std::env::var("CARGO_HOME")
        .map(|home| format!("{home}/bin/tansu"))
        .or_else(|_| std::env::var("HOME").map(|home| format!("{home}/.cargo/bin/tansu")));
    match installed {
        Ok(path) if Path::new(&path).exists() => path,
        _ => "tansu".to_string(),
    }
}

/// Length of the first message: as large as the 1 MiB workloads send.
const LARGE_MESSAGE_BYTES: usize = 1 << 20;

/// The payload of message `n`: an 8-byte big-endian sequence number (where
/// the runner puts its timestamp) and then bytes that differ by message and
/// length, so that a truncated, padded or swapped payload fails the check.
/// Message 0 is 1 MiB long; the others up to 2 KB.
fn payload(n: usize) -> Bytes {
    let length = if n == 0 {
        LARGE_MESSAGE_BYTES
    } else {
        8 + (n * 37) % 2_000
    };
    let mut bytes = (n as u64).to_be_bytes().to_vec();
    bytes.extend((0..length - 8).map(|i| (i * 31 + n * 7) as u8));
    Bytes::from(bytes)
}

/// What one subscription received, by partition.
type Received = Arc<Mutex<Vec<Vec<Vec<u8>>>>>;

fn collector() -> (Received, MessageSink) {
    let received: Received = Arc::new(Mutex::new(vec![Vec::new(); PARTITIONS]));
    let sink_received = received.clone();
    let sink: MessageSink = Arc::new(move |partition, payload: &[u8]| {
        sink_received.lock().expect("sink lock")[partition].push(payload.to_vec());
    });
    (received, sink)
}

fn count(received: &Received) -> usize {
    received.lock().unwrap().iter().map(Vec::len).sum()
}

/// Sends `MESSAGES` messages round-robin over the partitions, with a
/// subscription that reads while they are sent and one created afterwards
/// (it must catch up from the start), each split over two consumers.
async fn round_trip(driver: Box<dyn Driver>) {
    eprintln!("{}: {}", driver.name(), driver.durability());
    let topic = "peers-test-0";
    driver
        .create_topic(topic, PARTITIONS)
        .await
        .expect("creating the topic");
    let split = || (vec![0], (1..PARTITIONS).collect::<Vec<_>>());

    let (live, live_sink) = collector();
    let (first, rest) = split();
    let mut consumers = vec![
        driver
            .create_consumer(topic, "live", first, live_sink.clone())
            .await
            .expect("consumer"),
        driver
            .create_consumer(topic, "live", rest, live_sink)
            .await
            .expect("consumer"),
    ];

    // Sends go out several at a time, as the runner sends them, so a
    // partition's log may order concurrent sends either way: a subscription
    // must receive exactly the payloads sent, and both subscriptions the
    // same order.
    let producer = driver.create_producer(topic).await.expect("producer");
    let mut expected = vec![Vec::new(); PARTITIONS];
    let mut sends = Vec::new();
    for n in 0..MESSAGES {
        let partition = n % PARTITIONS;
        expected[partition].push(payload(n).to_vec());
        sends.push(producer.send(partition, payload(n)));
        if sends.len() == SENDS_INFLIGHT_MAX || n + 1 == MESSAGES {
            for result in join_all(sends.drain(..)).await {
                result.expect("send");
            }
        }
    }

    let (late, late_sink) = collector();
    let (first, rest) = split();
    consumers.push(
        driver
            .create_consumer(topic, "late", first, late_sink.clone())
            .await
            .expect("consumer"),
    );
    consumers.push(
        driver
            .create_consumer(topic, "late", rest, late_sink)
            .await
            .expect("consumer"),
    );

    for received in [&live, &late] {
        let started = Instant::now();
        while count(received) < MESSAGES && started.elapsed() < WAIT_MAX {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    {
        let live = live.lock().unwrap();
        let late = late.lock().unwrap();
        for partition in 0..PARTITIONS {
            assert!(
                live[partition] == late[partition],
                "partition {partition}: the subscriptions received different sequences"
            );
            let mut received = late[partition].clone();
            received.sort();
            expected[partition].sort();
            assert_eq!(
                received.len(),
                expected[partition].len(),
                "partition {partition}: message count"
            );
            assert!(
                received == expected[partition],
                "partition {partition}: the payloads received differ from those sent"
            );
        }
    }
    for consumer in consumers {
        consumer.close().await.expect("closing a consumer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs nats-server (benches/peers/run.sh installs it)"]
async fn nats_round_trip() {
    let server = start_nats();
    let driver = drivers::connect("nats", &server.endpoint, LARGE_MESSAGE_BYTES)
        .await
        .expect("connecting");
    round_trip(driver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server (benches/peers/run.sh installs it)"]
async fn redis_round_trip() {
    let server = start_redis();
    let driver = drivers::connect("redis", &server.endpoint, LARGE_MESSAGE_BYTES)
        .await
        .expect("connecting");
    assert!(
        driver.durability().contains("appendfsync always"),
        "{}",
        driver.durability()
    );
    round_trip(driver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs tansu (benches/peers/run.sh installs it)"]
async fn kafka_round_trip() {
    let server = start_tansu();
    let driver = drivers::connect("kafka", &server.endpoint, LARGE_MESSAGE_BYTES)
        .await
        .expect("connecting");
    round_trip(driver).await;
}
