//! OpenMessaging Benchmark workloads: `rotary bench --workload FILE`.
//!
//! Reads an OMB workload YAML ([`workload`]), runs it through a [`driver`]
//! against rotary or a peer ([`run`]), prints OMB's progress line every
//! period, and writes OMB's result JSON ([`result`]) and SVG charts
//! ([`chart`]). `rotary bench --chart-results A.json B.json --charts DIR`
//! draws several results, e.g. rotary's and a peer's, into one set of charts.
//!
//! With the rotary driver and no `--broker`, a broker is started in this
//! process with a temporary data directory, removed afterwards. For a
//! backlog workload (`consumerBacklogSizeGB > 0`) its journals also get a
//! `file://` fragment store in that directory and fragments of
//! [`BACKLOG_FRAGMENT_BYTES`]: the backlog is sealed and uploaded while it
//! builds, and held-back consumers catch up on sealed fragments.

pub mod chart;
pub mod clock;
pub mod driver;
pub mod drivers;
pub mod result;
pub mod run;
pub mod stats;
pub mod workload;

use crate::BenchArgs;
use anyhow::Context as _;
use rotary_engine::{Broker, ServeConfig};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub use result::TestResult;
pub use run::Options;
pub use workload::Workload;

/// Fragment length of a backlog workload's journals with the embedded
/// broker: small enough that most of the backlog is sealed and uploaded
/// before consumers start.
pub const BACKLOG_FRAGMENT_BYTES: u64 = 16 << 20;
/// Shortest and longest `--period`.
pub const PERIOD_SECS_MIN: f64 = 0.1;
pub const PERIOD_SECS_MAX: f64 = 3600.0;

/// A broker started in this process for one run.
struct Embedded {
    broker: Broker,
    endpoint: String,
}

fn start_embedded(args: &BenchArgs, data_dir: &Path, backlog: bool) -> anyhow::Result<Embedded> {
    let listen: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    let mut config = ServeConfig::new(data_dir.to_path_buf(), listen);
    config.cores = args.cores;
    config.cpus = args.broker_cpus.clone().map(|c| c.0).unwrap_or_default();
    if backlog {
        // Uploaded fragments leave the broker's disk at once, so held-back
        // consumers catch up from the store, as they would from a broker
        // that was replaced.
        config.local_cache_bytes = 0;
    }
    let broker = Broker::start(config)
        .with_context(|| format!("starting a broker in {}", data_dir.display()))?;
    let endpoint = broker.endpoints[0].to_string();
    eprintln!(
        "embedded broker: {} shards, shard 0 at {endpoint}",
        broker.endpoints.len()
    );
    Ok(Embedded { broker, endpoint })
}

/// `rotary bench --workload FILE`: runs it, writes `--output` and
/// `--charts`, and fails if the run did (after writing what it measured).
pub fn run_workload(args: &BenchArgs, path: &Path) -> anyhow::Result<()> {
    let workload = Workload::load(path)?;
    anyhow::ensure!(
        (PERIOD_SECS_MIN..=PERIOD_SECS_MAX).contains(&args.period_secs),
        "--period must be {PERIOD_SECS_MIN} to {PERIOD_SECS_MAX} seconds"
    );
    let options = Options {
        period: Duration::from_secs_f64(args.period_secs),
        progress: true,
        stall_timeout: run::STALL_TIMEOUT,
    };
    anyhow::ensure!(
        drivers::DRIVERS.contains(&args.driver.as_str()),
        "unknown driver {:?}; known drivers: {}",
        args.driver,
        drivers::DRIVERS.join(", ")
    );
    let backlog = workload.consumer_backlog_bytes > 0;
    let scratch = crate::scratch_dir(args)?;
    let (embedded, endpoint) = match &args.broker {
        Some(b) => (None, b.clone()),
        None => {
            anyhow::ensure!(
                args.driver == "rotary",
                "--driver {} needs --broker HOST:PORT (only rotary can be started here)",
                args.driver
            );
            eprintln!("scratch directory: {}", scratch.path().display());
            let e = start_embedded(args, &scratch.path().join("broker"), backlog)?;
            let endpoint = e.endpoint.clone();
            (Some(e), endpoint)
        }
    };
    let store = match &args.journal_store {
        Some(s) => Some(s.clone()),
        None if embedded.is_some() && backlog => {
            let dir = scratch.path().join("store");
            std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
            Some(format!("file://{}/", dir.display()))
        }
        None => None,
    };
    let rotary_options = drivers::rotary::RotaryOptions {
        fragment_length: store.as_ref().map(|_| BACKLOG_FRAGMENT_BYTES),
        store,
        durability: args.journal_durability,
    };

    let rt = crate::client_runtime(args)?;
    let outcome = rt.block_on(async {
        let driver: Box<dyn driver::Driver> = if args.driver == "rotary" {
            Box::new(
                drivers::rotary::RotaryDriver::connect(
                    &endpoint,
                    workload.message_size,
                    rotary_options,
                )
                .await?,
            )
        } else {
            drivers::connect(&args.driver, &endpoint, workload.message_size).await?
        };
        run::run(driver.as_ref(), &workload, &options).await
    });
    // Stop the client (its connection tasks) before the broker.
    rt.shutdown_timeout(Duration::from_secs(5));
    if let Some(e) = embedded {
        e.broker.shutdown();
    }
    drop(scratch);
    let result = outcome?;
    finish(args, &result)
}

/// Prints the summary, writes the JSON and charts, and turns the result's
/// problems into an error.
fn finish(args: &BenchArgs, result: &TestResult) -> anyhow::Result<()> {
    let json = result.to_json();
    let pl = result::Summary::of(&result.aggregate.publish_latency_us);
    let e2e = result::Summary::of(&result.aggregate.end_to_end_us);
    let pd = result::Summary::of(&result.aggregate.publish_delay_us);
    let mean = |key: &str| -> f64 {
        let v: Vec<f64> = json[key]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    eprintln!(
        "----- aggregated ({} periods) -----\n\
         Pub rate {:.1} msg/s / {:.1} MiB/s | Cons rate {:.1} msg/s\n\
         Pub Latency (ms) avg: {:.3} - 50%: {:.3} - 95%: {:.3} - 99%: {:.3} - 99.9%: {:.3} - 99.99%: {:.3} - Max: {:.3}\n\
         Pub Delay (us)   avg: {:.0} - 50%: {:.0} - 95%: {:.0} - 99%: {:.0} - 99.9%: {:.0} - 99.99%: {:.0} - Max: {:.0}\n\
         E2E Latency (ms) avg: {:.3} - 50%: {:.3} - 95%: {:.3} - 99%: {:.3} - 99.9%: {:.3} - 99.99%: {:.3} - Max: {:.3}\n\
         sent {} · received {} · publish errors {} · durability: {}",
        result.periods.len(),
        mean("publishRate"),
        mean("publishRate") * result.message_size as f64 / (1024.0 * 1024.0),
        mean("consumeRate"),
        pl.ms(0), pl.ms(1), pl.ms(3), pl.ms(4), pl.ms(5), pl.ms(6), pl.ms(7),
        pd.us[0], pd.us[1], pd.us[3], pd.us[4], pd.us[5], pd.us[6], pd.us[7],
        e2e.ms(0), e2e.ms(1), e2e.ms(3), e2e.ms(4), e2e.ms(5), e2e.ms(6), e2e.ms(7),
        json["messagesSent"], json["messagesReceived"], json["publishErrors"],
        json["durability"].as_str().unwrap_or("?"),
    );
    if let Some(path) = &args.output {
        std::fs::write(path, result.to_json_pretty())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &args.charts {
        let labelled = [chart::Labelled {
            label: result.driver.clone(),
            result: json.clone(),
        }];
        for p in chart::write(&labelled, dir)? {
            eprintln!("wrote {}", p.display());
        }
    }
    if !result.problems.is_empty() {
        anyhow::bail!("the run failed: {}", result.problems.join("; "));
    }
    Ok(())
}

/// `rotary bench --chart-results A.json … --charts DIR`.
pub fn chart_results(args: &BenchArgs) -> anyhow::Result<()> {
    let Some(dir) = &args.charts else {
        anyhow::bail!("--chart-results needs --charts DIR to write the charts into");
    };
    let results = chart::load_results(&args.chart_results)?;
    for p in chart::write(&results, dir)? {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
