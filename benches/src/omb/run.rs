//! Runs one workload against one connected driver.
//!
//! Phases: create fresh topics, producers and (unless the backlog test holds
//! them back) consumers; warm up (figures discarded); measure for the test
//! duration, building and draining the backlog if asked; stop sending, let
//! every send be answered, let consumers take in everything acknowledged;
//! check that every subscription received exactly what was acknowledged on
//! every partition.
//!
//! Sending is open loop. One pacer thread walks a schedule of evenly spaced
//! intended send times for all producers together (the aggregate
//! `producerRate`; message i goes to producer i mod P) and hands each
//! message to a task on the client runtime. A send's *delay* is how late it
//! started against its intended time; its *latency* is start → ack. When
//! [`IN_FLIGHT_BYTES_MAX`] worth of sends are unanswered the pacer waits,
//! and that wait shows up as delay on every send behind it: a stalled system
//! is charged for every message it held up (no coordinated omission).
//!
//! `producerRate: 0` finds the maximum sustainable rate: see [`Controller`].
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use super::clock::{self, Rng};
use super::driver::{Consumer, Driver, MessageSink, Producer};
use super::result::{Period, Summary, TestResult};
use super::stats::{Counters, Histos, Stats};
use super::workload::{KeyDistributor, Payloads, Workload, GB, TIMESTAMP_LEN};
use anyhow::Context as _;
use bytes::{Bytes, BytesMut};
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Bytes of sends unanswered at once, all producers together.
pub const IN_FLIGHT_BYTES_MAX: usize = 64 << 20;
/// Sends unanswered at once, whatever their size.
pub const IN_FLIGHT_MAX: usize = 10_000;
/// A send unanswered this long counts as an error.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// `producerRate: 0` starts here (OMB's starting point), messages/s.
pub const MAX_RATE_START: f64 = 10_000.0;
/// … and never goes below this.
pub const MAX_RATE_MIN: f64 = 10.0;
/// … nor above this.
pub const MAX_RATE_MAX: f64 = 10_000_000.0;
/// How often the maximum-rate controller looks.
pub const RATE_ADJUST_INTERVAL: Duration = Duration::from_secs(1);
/// A phase that waits on progress (backlog build, drain, the final
/// catch-up) gives up after this long without any, by default.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long sends may take to be answered once sending stops.
pub const SEND_DRAIN_TIMEOUT: Duration = SEND_TIMEOUT;
/// The pacer's first intended time lies this far after it starts.
const PACER_LEAD: Duration = Duration::from_millis(10);
/// How often the pacer looks again when every in-flight slot is taken.
const PACER_FULL_POLL: Duration = Duration::from_micros(100);
/// Longest single sleep of the pacer, so that it notices a stop.
const PACER_SLEEP_MAX: Duration = Duration::from_millis(10);
/// How often waiting phases look at the counters.
const POLL: Duration = Duration::from_millis(50);

/// How the runner reports, apart from the workload itself.
#[derive(Clone, Debug)]
pub struct Options {
    /// One progress line and one series value per period (OMB: 10 s).
    pub period: Duration,
    /// Print progress lines to stderr.
    pub progress: bool,
    /// How long a waiting phase may see no progress before it fails.
    pub stall_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            period: Duration::from_secs(10),
            progress: true,
            stall_timeout: STALL_TIMEOUT,
        }
    }
}

/// Per-partition counters: acknowledged sends per (topic, partition) and
/// receipts per (topic, subscription, partition).
struct Delivery {
    partitions: usize,
    subscriptions: usize,
    acked: Vec<AtomicU64>,
    received: Vec<AtomicU64>,
}

impl Delivery {
    fn new(w: &Workload) -> Delivery {
        let zeros = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        Delivery {
            partitions: w.partitions_per_topic,
            subscriptions: w.subscriptions_per_topic,
            acked: zeros(w.topics * w.partitions_per_topic),
            received: zeros(w.topics * w.subscriptions_per_topic * w.partitions_per_topic),
        }
    }

    fn received_at(&self, topic: usize, sub: usize, partition: usize) -> &AtomicU64 {
        &self.received[(topic * self.subscriptions + sub) * self.partitions + partition]
    }

    /// Every (topic, subscription, partition) whose receipts differ from the
    /// partition's acknowledged sends.
    fn mismatches(&self, topic_names: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for (t, name) in topic_names.iter().enumerate() {
            for s in 0..self.subscriptions {
                for p in 0..self.partitions {
                    let acked = self.acked[t * self.partitions + p].load(Ordering::Relaxed);
                    let got = self.received_at(t, s, p).load(Ordering::Relaxed);
                    if acked != got {
                        out.push(format!(
                            "topic {name} subscription {} partition {p}: received {got}, \
                             acknowledged {acked}",
                            subscription_name(s)
                        ));
                    }
                }
            }
        }
        out
    }
}

fn subscription_name(s: usize) -> String {
    format!("sub-{s:03}")
}

/// The shared target rate, changed by the maximum-rate controller.
struct Rate {
    msgs_per_s_bits: AtomicU64,
    /// Bumped on every change; the pacer re-anchors its schedule.
    generation: AtomicU64,
}

impl Rate {
    fn new(r: f64) -> Rate {
        Rate {
            msgs_per_s_bits: AtomicU64::new(r.to_bits()),
            generation: AtomicU64::new(0),
        }
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.msgs_per_s_bits.load(Ordering::Relaxed))
    }

    fn set(&self, r: f64) {
        self.msgs_per_s_bits.store(r.to_bits(), Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Release);
    }
}

/// One producer and how it picks partitions.
struct ProducerSlot {
    producer: Arc<dyn Producer>,
    topic: usize,
    next_partition: usize,
}

/// What the pacer shares with the runner.
struct PacerShared {
    stop: AtomicBool,
    /// Set when the pacer found every in-flight slot taken.
    saturated: AtomicBool,
    slots: Arc<Semaphore>,
    slots_total: usize,
    rate: Rate,
}

/// Payloads to send, each `messageSize` long; the first
/// [`TIMESTAMP_LEN`] bytes are overwritten at send time.
fn payload_pool(w: &Workload) -> anyhow::Result<Vec<Bytes>> {
    match &w.payloads {
        Payloads::File(path) => {
            let bytes = std::fs::read(path)
                .with_context(|| format!("reading payloadFile {}", path.display()))?;
            anyhow::ensure!(
                bytes.len() == w.message_size,
                "payloadFile {} changed size: {} bytes, messageSize {}",
                path.display(),
                bytes.len(),
                w.message_size
            );
            Ok(vec![Bytes::from(bytes)])
        }
        Payloads::Random {
            pool_size,
            random_ratio,
        } => {
            let mut rng = Rng::from_clock();
            let random_len = (w.message_size as f64 * random_ratio).round() as usize;
            Ok((0..*pool_size)
                .map(|_| {
                    let mut p = vec![0u8; w.message_size];
                    rng.fill(&mut p[..random_len.min(w.message_size)]);
                    Bytes::from(p)
                })
                .collect())
        }
    }
}

/// The pacer thread: sends on schedule until told to stop.
#[allow(clippy::too_many_arguments)]
fn pace(
    shared: Arc<PacerShared>,
    mut producers: Vec<ProducerSlot>,
    payloads: Vec<Bytes>,
    partitions: usize,
    keys: KeyDistributor,
    stats: Arc<Stats>,
    delivery: Arc<Delivery>,
    handle: tokio::runtime::Handle,
) {
    // Sleeps end within 1 µs of the deadline instead of 50 µs late: the
    // lateness would be charged to every send as delay.
    if let Err(e) = crate::sys::precise_sleeps() {
        eprintln!("warning: PR_SET_TIMERSLACK: {e}");
    }
    let mut rng = Rng::from_clock();
    let base = Instant::now() + PACER_LEAD;
    // Intended time of the next send, ns after `base`.
    let mut next_ns = 0f64;
    let mut generation = shared.rate.generation.load(Ordering::Acquire);
    let mut rate = shared.rate.get();
    let mut i = 0usize;
    while !shared.stop.load(Ordering::Relaxed) {
        let g = shared.rate.generation.load(Ordering::Acquire);
        if g != generation {
            generation = g;
            rate = shared.rate.get();
            // A new rate starts from now: sends owed under the old rate
            // are forgiven, or a rate cut would never catch up.
            let now_ns = Instant::now().saturating_duration_since(base).as_nanos() as f64;
            next_ns = next_ns.max(now_ns);
        }
        let intended = base + Duration::from_nanos(next_ns as u64);
        let now = Instant::now();
        if intended > now {
            std::thread::sleep((intended - now).min(PACER_SLEEP_MAX));
            continue;
        }
        let permit = match shared.slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                shared.saturated.store(true, Ordering::Relaxed);
                std::thread::sleep(PACER_FULL_POLL);
                continue;
            }
        };
        let count = producers.len();
        let slot = &mut producers[i % count];
        let partition = match keys {
            KeyDistributor::NoKey | KeyDistributor::KeyRoundRobin => {
                let p = slot.next_partition;
                slot.next_partition = (p + 1) % partitions;
                p
            }
            KeyDistributor::RandomNano => rng.below(partitions),
        };
        let producer = slot.producer.clone();
        let acked = slot.topic * partitions + partition;
        let payload = payloads[i % payloads.len()].clone();
        let stats = stats.clone();
        let delivery = delivery.clone();
        handle.spawn(async move {
            let started = Instant::now();
            stats.record_delay(clock::micros(started.saturating_duration_since(intended)));
            let mut stamped = BytesMut::from(&payload[..]);
            stamped[..TIMESTAMP_LEN].copy_from_slice(&clock::us_of(started).to_le_bytes());
            let len = stamped.len();
            let r = tokio::time::timeout(SEND_TIMEOUT, producer.send(partition, stamped.freeze()))
                .await;
            match r {
                Ok(Ok(())) => {
                    stats.record_ack(clock::micros(started.elapsed()), len);
                    delivery.acked[acked].fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => stats.record_error(&e),
                Err(_) => {
                    stats.record_error(&anyhow::anyhow!("send unanswered after {SEND_TIMEOUT:?}"))
                }
            }
            drop(permit);
        });
        i = i.wrapping_add(1);
        next_ns += 1e9 / rate;
    }
}

/// Finds the maximum sustainable rate (`producerRate: 0`). Every
/// [`RATE_ADJUST_INTERVAL`] it compares what was acknowledged in the
/// interval with the target:
///
/// * **falling behind** — the pacer found every in-flight slot taken, a
///   send failed, or the consumers' backlog grew by more than a tenth of
///   the interval's sends and exceeds one second of them: the target drops
///   to 90% of the rate actually acknowledged (never below
///   [`MAX_RATE_MIN`]);
/// * **keeping up** — at least 95% of the target was acknowledged and
///   neither sign above: the target rises by 20%;
/// * otherwise it holds.
///
/// A target change re-anchors the pacer's schedule at the present, so sends
/// owed under an old, too-high target are not sent in a burst. While the
/// backlog test builds its backlog on purpose, backlog growth is not a sign.
struct Controller {
    last: Counters,
    last_backlog: i64,
    at: Instant,
}

impl Controller {
    fn new(stats: &Stats, subscriptions: u64) -> Controller {
        let c = stats.counters();
        Controller {
            last: c,
            last_backlog: backlog(&c, subscriptions),
            at: Instant::now(),
        }
    }

    fn adjust(&mut self, shared: &PacerShared, stats: &Stats, subs: u64, backlog_is_wanted: bool) {
        let now = Instant::now();
        let secs = (now - self.at).as_secs_f64().max(1e-3);
        let c = stats.counters();
        let acked_rate = (c.sent - self.last.sent) as f64 / secs;
        let b = backlog(&c, subs);
        let saturated = shared.saturated.swap(false, Ordering::Relaxed);
        let window_sends = (c.sent - self.last.sent) as i64;
        let backlog_growing = !backlog_is_wanted
            && subs > 0
            && b - self.last_backlog > window_sends / 10
            && b as f64 > acked_rate;
        let target = shared.rate.get();
        let failed = c.errors > self.last.errors;
        if saturated || failed || backlog_growing {
            let r = (acked_rate.min(target) * 0.9).max(MAX_RATE_MIN);
            shared.rate.set(r);
        } else if acked_rate >= 0.95 * target {
            shared.rate.set((target * 1.2).min(MAX_RATE_MAX));
        }
        self.last = c;
        self.last_backlog = b;
        self.at = now;
    }
}

/// OMB's backlog: every subscription should receive every acknowledged
/// message; what it has not yet received is backlog.
fn backlog(c: &Counters, subscriptions: u64) -> i64 {
    (c.sent * subscriptions) as i64 - c.received as i64
}

/// Commands to the reporter task.
enum Command {
    /// Warm-up is over: discard what was recorded, start the series.
    Measure,
    /// The measured phase is over: hand over the series and aggregates.
    Finish(oneshot::Sender<(Vec<Period>, Histos)>),
}

/// Prints a progress line every period and keeps the measured series.
async fn report(
    stats: Arc<Stats>,
    period: Duration,
    subscriptions: u64,
    message_size: usize,
    progress: bool,
    rate: Arc<PacerShared>,
    mut commands: mpsc::Receiver<Command>,
) {
    let mut measuring = false;
    let mut current = Histos::new();
    let mut aggregate = Histos::new();
    let mut periods = Vec::new();
    let mut last = stats.counters();
    let mut last_at = Instant::now();
    let started = last_at;
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {
                next += period;
                let now = Instant::now();
                stats.take_period(&mut current);
                let c = stats.counters();
                let secs = (now - last_at).as_secs_f64();
                let p = period_of(&c, &last, secs, subscriptions, &current);
                if progress {
                    let phase = if measuring { "" } else { " (warm-up)" };
                    eprintln!(
                        "{:>7.1}s{phase} {}",
                        (now - started).as_secs_f64(),
                        progress_line(&p, message_size, rate.rate.get())
                    );
                }
                if measuring {
                    aggregate.add(&current);
                    periods.push(p);
                }
                current.reset();
                last = c;
                last_at = now;
            }
            cmd = commands.recv() => match cmd {
                Some(Command::Measure) => {
                    stats.take_period(&mut current);
                    current.reset();
                    measuring = true;
                    last = stats.counters();
                    last_at = Instant::now();
                    next = tokio::time::Instant::now() + period;
                }
                Some(Command::Finish(reply)) => {
                    // The last, partial period still counts in the
                    // aggregates (a backlog drain may lie wholly in it);
                    // it gets a series value only if it is at least half
                    // a period long, so rates are not taken over a sliver.
                    if measuring {
                        stats.take_period(&mut current);
                        let secs = last_at.elapsed().as_secs_f64();
                        if secs >= period.as_secs_f64() / 2.0 {
                            let c = stats.counters();
                            periods.push(period_of(&c, &last, secs, subscriptions, &current));
                        }
                        aggregate.add(&current);
                    }
                    let _ = reply.send((periods, aggregate));
                    return;
                }
                None => return,
            }
        }
    }
}

/// The figures of a period of `secs` seconds that ended at `c`.
fn period_of(c: &Counters, last: &Counters, secs: f64, subscriptions: u64, h: &Histos) -> Period {
    let secs = secs.max(1e-9);
    Period {
        publish_rate: (c.sent - last.sent) as f64 / secs,
        publish_error_rate: (c.errors - last.errors) as f64 / secs,
        consume_rate: (c.received - last.received) as f64 / secs,
        backlog: backlog(c, subscriptions),
        publish_latency: Summary::of(&h.publish_latency_us),
        publish_delay: Summary::of(&h.publish_delay_us),
        end_to_end: Summary::of(&h.end_to_end_us),
    }
}

/// One progress line, as OMB prints it.
pub fn progress_line(p: &Period, message_size: usize, target_rate: f64) -> String {
    let mib = |rate: f64| rate * message_size as f64 / (1024.0 * 1024.0);
    let l = &p.publish_latency;
    let d = &p.publish_delay;
    format!(
        "Pub rate {:.1} msg/s / {:.1} MiB/s | Pub err {:.1} err/s | Cons rate {:.1} msg/s / {:.1} MiB/s \
         | Backlog: {:.1} K | Pub Latency (ms) avg: {:.3} - 50%: {:.3} - 99%: {:.3} - 99.9%: {:.3} \
         - Max: {:.3} | Pub Delay (us) avg: {:.0} - 50%: {:.0} - 99%: {:.0} - 99.9%: {:.0} - Max: {:.0} \
         | target {:.0} msg/s",
        p.publish_rate,
        mib(p.publish_rate),
        p.publish_error_rate,
        p.consume_rate,
        mib(p.consume_rate),
        p.backlog as f64 / 1000.0,
        l.ms(0),
        l.ms(1),
        l.ms(4),
        l.ms(5),
        l.ms(7),
        d.us[0],
        d.us[1],
        d.us[4],
        d.us[5],
        d.us[7],
        target_rate,
    )
}

/// The backlog test's figures.
#[derive(Debug, Default, Clone)]
struct Drain {
    target_bytes: u64,
    built_bytes: u64,
    build_secs: f64,
    drained_messages: u64,
    drain_secs: f64,
    completed: bool,
}

/// A unique prefix for this run's topic names: letters, digits and `-`
/// only, so every driver's naming rules accept it.
fn run_id() -> String {
    let unix_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("omb-{unix_secs}-{}", std::process::id())
}

/// Waits until `done` says so, failing if `progress` stays the same for
/// `stall`.
async fn wait_for(
    what: &str,
    stall: Duration,
    mut done: impl FnMut() -> bool,
    mut progress: impl FnMut() -> u64,
) -> anyhow::Result<()> {
    let mut seen = progress();
    let mut moved_at = Instant::now();
    while !done() {
        tokio::time::sleep(POLL).await;
        let now_seen = progress();
        if now_seen != seen {
            seen = now_seen;
            moved_at = Instant::now();
        } else if moved_at.elapsed() >= stall {
            anyhow::bail!("{what}: no progress for {stall:?}");
        }
    }
    Ok(())
}

/// Everything the consumers of one run need.
struct ConsumerPlan {
    topic: usize,
    subscription: usize,
    partitions: Vec<usize>,
}

fn consumer_plans(w: &Workload) -> Vec<ConsumerPlan> {
    let mut plans = Vec::new();
    for topic in 0..w.topics {
        for subscription in 0..w.subscriptions_per_topic {
            for c in 0..w.consumer_per_subscription {
                // Consumers of a subscription split its partitions; a
                // consumer left without any is not started.
                let partitions: Vec<usize> = (0..w.partitions_per_topic)
                    .filter(|p| p % w.consumer_per_subscription == c)
                    .collect();
                if !partitions.is_empty() {
                    plans.push(ConsumerPlan {
                        topic,
                        subscription,
                        partitions,
                    });
                }
            }
        }
    }
    plans
}

fn sink(
    topic: usize,
    subscription: usize,
    partitions: usize,
    stats: Arc<Stats>,
    delivery: Arc<Delivery>,
) -> MessageSink {
    Arc::new(move |partition: usize, payload: &[u8]| {
        let now = clock::now_us();
        if payload.len() < TIMESTAMP_LEN || partition >= partitions {
            stats.record_malformed();
            return;
        }
        let mut ts = [0u8; TIMESTAMP_LEN];
        ts.copy_from_slice(&payload[..TIMESTAMP_LEN]);
        let sent_us = u64::from_le_bytes(ts);
        stats.record_receive(now.saturating_sub(sent_us), payload.len());
        delivery
            .received_at(topic, subscription, partition)
            .fetch_add(1, Ordering::Relaxed);
    })
}

async fn start_consumers(
    driver: &dyn Driver,
    plans: &[ConsumerPlan],
    topic_names: &[String],
    partitions: usize,
    stats: &Arc<Stats>,
    delivery: &Arc<Delivery>,
) -> anyhow::Result<Vec<Box<dyn Consumer>>> {
    let mut consumers = Vec::with_capacity(plans.len());
    for plan in plans {
        let topic = &topic_names[plan.topic];
        let sub = subscription_name(plan.subscription);
        let c = driver
            .create_consumer(
                topic,
                &sub,
                plan.partitions.clone(),
                sink(
                    plan.topic,
                    plan.subscription,
                    partitions,
                    stats.clone(),
                    delivery.clone(),
                ),
            )
            .await
            .with_context(|| format!("creating a consumer of {topic} {sub}"))?;
        consumers.push(c);
    }
    Ok(consumers)
}

/// Runs `w` against `driver`. The result is returned also when the run
/// failed in a way its figures explain (nothing consumed, a delivery
/// mismatch): see [`TestResult::problems`].
pub async fn run(
    driver: &dyn Driver,
    w: &Workload,
    options: &Options,
) -> anyhow::Result<TestResult> {
    anyhow::ensure!(
        options.period >= Duration::from_millis(100),
        "the period must be at least 0.1 s"
    );
    let id = run_id();
    let topic_names: Vec<String> = (0..w.topics).map(|t| format!("{id}-t{t:03}")).collect();
    announce(driver, w);
    for t in &topic_names {
        driver
            .create_topic(t, w.partitions_per_topic)
            .await
            .with_context(|| format!("creating topic {t}"))?;
    }
    let producers = create_producers(driver, w, &topic_names).await?;
    let mut run = Run::new(driver, w, options, topic_names);
    if !run.backlog_test {
        run.consumers = run.start_consumers().await?;
    }
    let sending = Sending::start(&run, producers)?;
    let shared = sending.shared.clone();
    // The phases; on an error, sending stops and consumers close all the same.
    let phases = run.phases(&sending).await;
    let sent = sending.stop().await?;
    let mut problems = Vec::new();
    if let Err(e) = &phases {
        problems.push(format!("{e:#}"));
    }
    let consumer_errors = run.settle(&shared, &mut problems).await;
    let (c, mismatches) = run.check(&consumer_errors, &mut problems);
    let extra = run.extra(&c, mismatches, consumer_errors, sent.final_rate);
    Ok(TestResult {
        workload: w.name.clone(),
        driver: driver.name(),
        message_size: w.message_size,
        topics: w.topics,
        partitions: w.partitions_per_topic,
        producers_per_topic: w.producers_per_topic,
        consumers_per_topic: w.consumers_per_topic(),
        period_ms: options.period.as_millis() as u64,
        periods: sent.periods,
        aggregate: sent.aggregate,
        extra,
        problems,
    })
}

/// The run's first line on stderr: the workload's shape and the driver.
fn announce(driver: &dyn Driver, w: &Workload) {
    eprintln!(
        "workload {:?}: {} topic(s) × {} partition(s), {} B messages, {} producer(s)/topic, \
         {} subscription(s) × {} consumer(s)/topic, rate {}, driver {} ({})",
        w.name,
        w.topics,
        w.partitions_per_topic,
        w.message_size,
        w.producers_per_topic,
        w.subscriptions_per_topic,
        w.consumer_per_subscription,
        if w.producer_rate == 0 {
            "max".to_string()
        } else {
            format!("{}/s", w.producer_rate)
        },
        driver.name(),
        driver.durability(),
    );
}

async fn create_producers(
    driver: &dyn Driver,
    w: &Workload,
    topic_names: &[String],
) -> anyhow::Result<Vec<ProducerSlot>> {
    let mut producers = Vec::with_capacity(w.producers_total());
    for (topic, name) in topic_names.iter().enumerate() {
        for k in 0..w.producers_per_topic {
            let p = driver
                .create_producer(name)
                .await
                .with_context(|| format!("creating a producer of {name}"))?;
            producers.push(ProducerSlot {
                producer: Arc::from(p),
                topic,
                // Producers of one topic start on different partitions.
                next_partition: k % w.partitions_per_topic,
            });
        }
    }
    Ok(producers)
}

/// What the phases of one run share.
struct Run<'a> {
    driver: &'a dyn Driver,
    w: &'a Workload,
    options: &'a Options,
    topic_names: Vec<String>,
    stats: Arc<Stats>,
    delivery: Arc<Delivery>,
    /// Subscriptions per topic: how many times every message is consumed.
    subs: u64,
    plans: Vec<ConsumerPlan>,
    /// The backlog test holds consumers back until its backlog is built.
    backlog_test: bool,
    consumers: Vec<Box<dyn Consumer>>,
    drain: Drain,
}

/// The sending side of a run and the tasks that watch it.
struct Sending {
    shared: Arc<PacerShared>,
    commands: mpsc::Sender<Command>,
    reporter: tokio::task::JoinHandle<()>,
    pacer: std::thread::JoinHandle<()>,
    /// Set while the backlog test builds its backlog on purpose.
    building: Arc<AtomicBool>,
    controller: Option<tokio::task::JoinHandle<()>>,
}

/// What the reporter measured, and the rate the run ended at.
struct Sent {
    periods: Vec<Period>,
    aggregate: Histos,
    final_rate: f64,
}

impl Sending {
    /// Starts the reporter, the pacer and (for `producerRate: 0`) the
    /// maximum-rate controller.
    fn start(run: &Run<'_>, producers: Vec<ProducerSlot>) -> anyhow::Result<Sending> {
        let w = run.w;
        let slots_total = (IN_FLIGHT_BYTES_MAX / w.message_size).clamp(1, IN_FLIGHT_MAX);
        let start_rate = if w.producer_rate == 0 {
            MAX_RATE_START
        } else {
            w.producer_rate as f64
        };
        let shared = Arc::new(PacerShared {
            stop: AtomicBool::new(false),
            saturated: AtomicBool::new(false),
            slots: Arc::new(Semaphore::new(slots_total)),
            slots_total,
            rate: Rate::new(start_rate),
        });
        let (commands, command_rx) = mpsc::channel(4);
        let reporter = tokio::spawn(report(
            run.stats.clone(),
            run.options.period,
            run.subs,
            w.message_size,
            run.options.progress,
            shared.clone(),
            command_rx,
        ));
        let pacer = start_pacer(run, &shared, producers)?;
        let building = Arc::new(AtomicBool::new(run.backlog_test));
        let controller = (w.producer_rate == 0)
            .then(|| start_controller(&shared, &run.stats, run.subs, &building));
        Ok(Sending {
            shared,
            commands,
            reporter,
            pacer,
            building,
            controller,
        })
    }

    /// Ends the measured series, stops sending and waits for the pacer and
    /// the reporter to end.
    async fn stop(self) -> anyhow::Result<Sent> {
        let (reply, series) = oneshot::channel();
        let _ = self.commands.send(Command::Finish(reply)).await;
        let (periods, aggregate) = series.await.unwrap_or_default();
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(c) = self.controller {
            c.abort();
        }
        let final_rate = self.shared.rate.get();
        let pacer = self.pacer;
        tokio::task::spawn_blocking(move || pacer.join())
            .await
            .context("joining the pacer")?
            .map_err(|_| anyhow::anyhow!("the pacer thread panicked"))?;
        let _ = self.reporter.await;
        Ok(Sent {
            periods,
            aggregate,
            final_rate,
        })
    }
}

fn start_pacer(
    run: &Run<'_>,
    shared: &Arc<PacerShared>,
    producers: Vec<ProducerSlot>,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let shared = shared.clone();
    let payloads = payload_pool(run.w)?;
    let stats = run.stats.clone();
    let delivery = run.delivery.clone();
    let handle = tokio::runtime::Handle::current();
    let (partitions, keys) = (run.w.partitions_per_topic, run.w.key_distributor);
    std::thread::Builder::new()
        .name("rotary-omb-pacer".into())
        .spawn(move || {
            pace(
                shared, producers, payloads, partitions, keys, stats, delivery, handle,
            )
        })
        .context("starting the pacer thread")
}

fn start_controller(
    shared: &Arc<PacerShared>,
    stats: &Arc<Stats>,
    subs: u64,
    building: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let shared = shared.clone();
    let stats = stats.clone();
    let building = building.clone();
    tokio::spawn(async move {
        let mut c = Controller::new(&stats, subs);
        loop {
            tokio::time::sleep(RATE_ADJUST_INTERVAL).await;
            c.adjust(&shared, &stats, subs, building.load(Ordering::Relaxed));
        }
    })
}

impl<'a> Run<'a> {
    fn new(
        driver: &'a dyn Driver,
        w: &'a Workload,
        options: &'a Options,
        topic_names: Vec<String>,
    ) -> Run<'a> {
        Run {
            driver,
            w,
            options,
            topic_names,
            stats: Arc::new(Stats::new()),
            delivery: Arc::new(Delivery::new(w)),
            subs: w.subscriptions_per_topic as u64,
            plans: consumer_plans(w),
            backlog_test: w.consumer_backlog_bytes > 0,
            consumers: Vec::new(),
            drain: Drain {
                target_bytes: w.consumer_backlog_bytes,
                ..Drain::default()
            },
        }
    }

    async fn start_consumers(&self) -> anyhow::Result<Vec<Box<dyn Consumer>>> {
        start_consumers(
            self.driver,
            &self.plans,
            &self.topic_names,
            self.w.partitions_per_topic,
            &self.stats,
            &self.delivery,
        )
        .await
    }

    /// Warm-up, then the measured phase (with the backlog test's build and
    /// drain in it).
    async fn phases(&mut self, sending: &Sending) -> anyhow::Result<()> {
        tokio::time::sleep(self.w.warmup_duration).await;
        let _ = sending.commands.send(Command::Measure).await;
        let measure_end = Instant::now() + self.w.test_duration;
        if self.backlog_test {
            let backlog_at_start = self.build_backlog(&sending.building).await?;
            self.drain_backlog(backlog_at_start).await?;
        }
        let now = Instant::now();
        if measure_end > now {
            tokio::time::sleep(measure_end - now).await;
        }
        anyhow::Ok(())
    }

    /// Sends with no consumer until the backlog test's target is retained;
    /// returns the backlog then, in messages.
    async fn build_backlog(&mut self, building: &AtomicBool) -> anyhow::Result<u64> {
        let (w, subs, stats) = (self.w, self.subs, self.stats.clone());
        let target = w.consumer_backlog_bytes;
        eprintln!(
            "backlog: holding consumers back until {:.1} MiB are retained",
            target as f64 / (1 << 20) as f64
        );
        let build_start = Instant::now();
        let backlog_bytes =
            || backlog(&stats.counters(), subs).max(0) as u64 * w.message_size as u64;
        wait_for(
            "building the backlog",
            self.options.stall_timeout,
            || backlog_bytes() >= target,
            || stats.counters().sent + stats.counters().errors,
        )
        .await?;
        let built = backlog_bytes();
        let backlog_at_start = backlog(&stats.counters(), subs).max(0) as u64;
        self.drain.built_bytes = built;
        self.drain.build_secs = build_start.elapsed().as_secs_f64();
        building.store(false, Ordering::Relaxed);
        eprintln!(
            "backlog: {:.1} MiB retained after {:.1} s; starting consumers at the beginning",
            built as f64 / (1 << 20) as f64,
            build_start.elapsed().as_secs_f64()
        );
        Ok(backlog_at_start)
    }

    /// Starts the consumers at the beginning and waits until they took in
    /// the backlog.
    async fn drain_backlog(&mut self, backlog_at_start: u64) -> anyhow::Result<()> {
        let (w, subs, stats) = (self.w, self.subs, self.stats.clone());
        let drain_start = Instant::now();
        let received_before = stats.counters().received;
        self.consumers = self.start_consumers().await?;
        // Drained: what is left is what the drain ratio leaves, or less
        // than 1% of the backlog (messages published meanwhile keep
        // arriving, so zero may never be seen while sending).
        let capacity = w.backlog_messages() * subs;
        let floor = (((1.0 - w.backlog_drain_ratio) * capacity as f64) as u64).max(capacity / 100);
        wait_for(
            "draining the backlog",
            self.options.stall_timeout,
            || backlog(&stats.counters(), subs) <= floor as i64,
            || stats.counters().received,
        )
        .await?;
        let d = &mut self.drain;
        d.drain_secs = drain_start.elapsed().as_secs_f64();
        d.drained_messages = stats.counters().received - received_before;
        d.completed = true;
        let drained_bytes = d.drained_messages * w.message_size as u64;
        eprintln!(
            "backlog: drained {} messages ({:.1} MiB) in {:.1} s: {:.0} msg/s, {:.1} MiB/s \
             (backlog was {backlog_at_start} messages)",
            d.drained_messages,
            drained_bytes as f64 / (1 << 20) as f64,
            d.drain_secs,
            d.drained_messages as f64 / d.drain_secs.max(1e-9),
            drained_bytes as f64 / (1 << 20) as f64 / d.drain_secs.max(1e-9),
        );
        Ok(())
    }

    /// Once sending stopped: every send answered, consumers caught up and
    /// closed. Returns the consumers' errors.
    async fn settle(&mut self, shared: &PacerShared, problems: &mut Vec<String>) -> Vec<String> {
        // Every send answered: every slot free again.
        let answered = tokio::time::timeout(
            SEND_DRAIN_TIMEOUT,
            shared.slots.acquire_many(shared.slots_total as u32),
        )
        .await;
        if answered.is_err() {
            problems.push(format!(
                "sends still unanswered {SEND_DRAIN_TIMEOUT:?} after sending stopped"
            ));
        }
        // Consumers take in everything acknowledged (or stall).
        if !self.consumers.is_empty() {
            let (stats, subs) = (&self.stats, self.subs);
            let caught_up = wait_for(
                "consumers catching up after sending stopped",
                self.options.stall_timeout,
                || backlog(&stats.counters(), subs) <= 0,
                || stats.counters().received,
            )
            .await;
            if let Err(e) = caught_up {
                problems.push(format!("{e:#}"));
            }
        }
        let mut consumer_errors = Vec::new();
        for c in std::mem::take(&mut self.consumers) {
            if let Err(e) = c.close().await {
                consumer_errors.push(format!("{e:#}"));
            }
        }
        consumer_errors
    }

    /// The problems the final counters show; returns those counters and the
    /// partitions whose receipts differ from their acknowledged sends.
    fn check(
        &self,
        consumer_errors: &[String],
        problems: &mut Vec<String>,
    ) -> (Counters, Vec<String>) {
        let stats = &self.stats;
        let c = stats.counters();
        let mismatches = self.delivery.mismatches(&self.topic_names);
        if !self.plans.is_empty() && c.received == 0 {
            problems.push(format!(
                "nothing was consumed: {} consumer(s) received no message of the {} acknowledged",
                self.plans.len(),
                c.sent
            ));
        }
        if c.sent == 0 {
            problems.push(match stats.first_error() {
                Some(e) => format!("no send was acknowledged ({} failed; first: {e})", c.errors),
                None => "no send was acknowledged".to_string(),
            });
        }
        if !mismatches.is_empty() && c.errors == 0 {
            // Without failed sends (whose fate is unknown) every subscription
            // must have received exactly what was acknowledged.
            problems.push(format!(
                "{} subscription partition(s) did not receive exactly what was acknowledged; \
                 first: {}",
                mismatches.len(),
                mismatches[0]
            ));
        }
        if stats.malformed() > 0 {
            problems.push(format!(
                "{} received message(s) too short for a timestamp or from an unknown partition",
                stats.malformed()
            ));
        }
        if !consumer_errors.is_empty() {
            problems.push(format!("consumer failed: {}", consumer_errors[0]));
        }
        if c.errors > 0 {
            eprintln!(
                "warning: {} send(s) failed; first: {}",
                c.errors,
                stats.first_error().unwrap_or_default()
            );
        }
        (c, mismatches)
    }

    /// The result's figures beyond OMB's own.
    fn extra(
        &self,
        c: &Counters,
        mismatches: Vec<String>,
        consumer_errors: Vec<String>,
        final_rate: f64,
    ) -> super::result::Map {
        let w = self.w;
        let mut extra = super::result::Map::new();
        extra.insert("durability".into(), json!(self.driver.durability()));
        extra.insert("producerRate".into(), json!(w.producer_rate));
        if w.producer_rate == 0 {
            extra.insert("maxRateFinal".into(), json!(final_rate.round()));
        }
        extra.insert(
            "testDurationSeconds".into(),
            json!(w.test_duration.as_secs_f64()),
        );
        extra.insert(
            "warmupDurationSeconds".into(),
            json!(w.warmup_duration.as_secs_f64()),
        );
        extra.insert(
            "subscriptionsPerTopic".into(),
            json!(w.subscriptions_per_topic),
        );
        extra.insert("topicNames".into(), json!(self.topic_names));
        extra.insert("messagesSent".into(), json!(c.sent));
        extra.insert("messagesReceived".into(), json!(c.received));
        extra.insert("publishErrors".into(), json!(c.errors));
        extra.insert("firstPublishError".into(), json!(self.stats.first_error()));
        extra.insert("finalBacklog".into(), json!(backlog(c, self.subs)));
        extra.insert("deliveryMismatches".into(), json!(mismatches));
        extra.insert("consumerErrors".into(), json!(consumer_errors));
        if self.backlog_test {
            extra.insert("backlogDrain".into(), self.drain_json());
        }
        extra
    }

    /// The backlog test's figures, as the result carries them.
    fn drain_json(&self) -> serde_json::Value {
        let d = &self.drain;
        let drained_bytes = d.drained_messages * self.w.message_size as u64;
        json!({
            "targetGB": d.target_bytes as f64 / GB,
            "builtBytes": d.built_bytes,
            "buildSeconds": d.build_secs,
            "drainRatio": self.w.backlog_drain_ratio,
            "drainedMessages": d.drained_messages,
            "drainedBytes": drained_bytes,
            "drainSeconds": d.drain_secs,
            "drainRateMsgs": d.drained_messages as f64 / d.drain_secs.max(1e-9),
            "drainRateMiBs": drained_bytes as f64 / (1u64 << 20) as f64 / d.drain_secs.max(1e-9),
            "completed": d.completed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(partitions: usize, consumers: usize) -> Workload {
        let text = format!(
            "name: t\ntopics: 2\npartitionsPerTopic: {partitions}\nmessageSize: 16\n\
             useRandomizedPayloads: true\nrandomizedPayloadPoolSize: 1\nsubscriptionsPerTopic: 2\n\
             consumerPerSubscription: {consumers}\nproducersPerTopic: 1\nproducerRate: 1\n\
             testDurationMinutes: 1\n"
        );
        Workload::parse(&text, None).unwrap()
    }

    #[test]
    fn consumers_split_partitions_and_cover_each_once_per_subscription() {
        let w = workload(5, 2);
        let plans = consumer_plans(&w);
        assert_eq!(plans.len(), 2 * 2 * 2);
        for t in 0..2 {
            for s in 0..2 {
                let mut all: Vec<usize> = plans
                    .iter()
                    .filter(|p| p.topic == t && p.subscription == s)
                    .flat_map(|p| p.partitions.clone())
                    .collect();
                all.sort();
                assert_eq!(all, vec![0, 1, 2, 3, 4]);
            }
        }
        // More consumers than partitions: the extra ones are not started.
        assert_eq!(consumer_plans(&workload(1, 3)).len(), 2 * 2);
    }

    #[test]
    fn delivery_names_each_mismatch() {
        let w = workload(2, 1);
        let d = Delivery::new(&w);
        let names = vec!["a".to_string(), "b".to_string()];
        d.acked[1].fetch_add(3, Ordering::Relaxed);
        for s in 0..2 {
            d.received_at(0, s, 1).fetch_add(3, Ordering::Relaxed);
        }
        assert!(d.mismatches(&names).is_empty());
        d.received_at(1, 1, 0).fetch_add(1, Ordering::Relaxed);
        let m = d.mismatches(&names);
        assert_eq!(m.len(), 1);
        assert!(m[0].contains("topic b subscription sub-001 partition 0: received 1"));
    }

    #[test]
    fn backlog_counts_every_subscription() {
        let c = Counters {
            sent: 10,
            received: 15,
            ..Counters::default()
        };
        assert_eq!(backlog(&c, 2), 5);
    }
}
