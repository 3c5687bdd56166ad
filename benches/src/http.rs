//! `http` (only when asked for by name): what the HTTP listener costs and
//! what the gateway delivers, on an embedded broker with its HTTP server
//! in this process.
//!
//! 1. `latency-1k` and `append-1m` with `/metrics` scraped every second and
//!    without, alternating (`--http-rounds` rounds of each), each run's
//!    CPU time of this process (broker, HTTP server and load generator)
//!    per append beside its p99 and throughput.
//! 2. 1 KiB appends, closed loop, `--http-clients` at once: through the
//!    gateway (`PUT` on keep-alive connections) and through the native
//!    client, in the same run: appends/s and latency percentiles.
//!
//! Figures are printed as a table of their own; nothing is asserted.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rotary_net::client::Client;
use rotary_net::spec::JournalSpec;
use rotary_net::wire::AppendRequest;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::report::{self, Percentiles};
use crate::BenchArgs;

const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);
const PUT_BYTES: usize = 1 << 10;

/// CPU seconds this process has used.
fn process_cpu_secs() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
    #[allow(unsafe_code)]
    // SAFETY: ru is a valid out-pointer for getrusage.
    let ru = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) != 0 {
            return 0.0;
        }
        ru.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// A GET /metrics every [`SCRAPE_INTERVAL`] until dropped.
struct Scraper {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Scraper {
    fn start(http: std::net::SocketAddr) -> Scraper {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut scrapes = 0;
            while !flag.load(Ordering::Relaxed) {
                if let Ok(mut s) = std::net::TcpStream::connect(http) {
                    let _ = s.write_all(
                        b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: application/openmetrics-text\r\nConnection: close\r\n\r\n",
                    );
                    let mut sink = Vec::new();
                    if s.read_to_end(&mut sink).is_ok() && sink.starts_with(b"HTTP/1.1 200") {
                        scrapes += 1;
                    }
                }
                let until = Instant::now() + SCRAPE_INTERVAL;
                while Instant::now() < until && !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            scrapes
        });
        Scraper {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

struct Row {
    what: String,
    appends_per_s: f64,
    mb_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us_per_append: f64,
}

async fn make_journal(client: &Client, name: &str) -> anyhow::Result<()> {
    let mut spec = JournalSpec::new(name);
    spec.fragment.compression_codec = rotary_net::spec::Codec::None;
    client
        .apply(std::slice::from_ref(&spec))
        .await
        .with_context(|| format!("creating {name}"))?;
    Ok(())
}

/// One closed-loop worker's appends through the gateway on a keep-alive
/// connection.
async fn http_worker(
    http: std::net::SocketAddr,
    journal: String,
    body: bytes::Bytes,
    end: Instant,
    measure_from: Instant,
) -> anyhow::Result<(hdrhistogram::Histogram<u64>, u64)> {
    let stream = tokio::net::TcpStream::connect(http).await?;
    stream.set_nodelay(true)?;
    let (r, mut w) = stream.into_split();
    let mut r = tokio::io::BufReader::new(r);
    let head = format!(
        "PUT /{journal} HTTP/1.1\r\nHost: bench\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(&body);
    let mut h = report::histogram();
    let mut done = 0;
    let mut line = String::new();
    while Instant::now() < end {
        let sent = Instant::now();
        w.write_all(&request).await?;
        line.clear();
        r.read_line(&mut line).await?;
        anyhow::ensure!(line.starts_with("HTTP/1.1 204"), "PUT answered {line:?}");
        let mut length = 0usize;
        loop {
            line.clear();
            r.read_line(&mut line).await?;
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        if length > 0 {
            let mut skip = vec![0u8; length];
            r.read_exact(&mut skip).await?;
        }
        if sent >= measure_from {
            report::record(&mut h, sent.elapsed());
            done += 1;
        }
    }
    Ok((h, done))
}

async fn native_worker(
    client: Client,
    journal: String,
    body: bytes::Bytes,
    end: Instant,
    measure_from: Instant,
) -> anyhow::Result<(hdrhistogram::Histogram<u64>, u64)> {
    let req = AppendRequest {
        journal,
        ..Default::default()
    };
    let mut h = report::histogram();
    let mut done = 0;
    while Instant::now() < end {
        let sent = Instant::now();
        client.append(&req, body.clone()).await?;
        if sent >= measure_from {
            report::record(&mut h, sent.elapsed());
            done += 1;
        }
    }
    Ok((h, done))
}

/// Runs the `http` scenario.
pub fn run(args: &BenchArgs, data_dir: &std::path::Path) -> anyhow::Result<()> {
    let listen: std::net::SocketAddr = "127.0.0.1:0".parse().expect("address");
    let mut config = rotary_engine::ServeConfig::new(data_dir.to_path_buf(), listen);
    config.cores = args.cores;
    config.cpus = args.broker_cpus.clone().map(|c| c.0).unwrap_or_default();
    let http_server = rotary_http::HttpServer::start(rotary_http::HttpConfig::new(listen))
        .context("starting the HTTP server")?;
    let broker = rotary_engine::Broker::start(config).context("starting a broker")?;
    http_server.started(&broker);
    let http = http_server.local_addr();
    let endpoint = broker.endpoints[0].to_string();
    eprintln!("http: broker at {endpoint}, HTTP at {http}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads.max(1))
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    let result = rt.block_on(async {
        let client = Client::connect(&endpoint).await?;
        let prefix = format!("bench/http-{}", std::process::id());
        let bench = Bench {
            client: &client,
            args,
            http,
            prefix: &prefix,
        };
        wait_ready(http).await?;
        for round in 0..args.http_rounds {
            for scraped in [false, true] {
                rows.push(bench.latency_row(round, scraped).await?);
                rows.push(bench.throughput_row(round, scraped).await?);
            }
        }
        let (body, _) = crate::load::content(PUT_BYTES);
        for via in ["native", "http-put"] {
            rows.push(bench.put_row(via, &body).await?);
        }
        anyhow::Ok(())
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    http_server.stopping();
    broker.shutdown();
    result?;
    print_rows(&rows);
    Ok(())
}

/// Waits until the gateway is ready: once its own client reached the broker.
async fn wait_ready(http: std::net::SocketAddr) -> anyhow::Result<()> {
    for _ in 0..500 {
        let mut s = tokio::net::TcpStream::connect(http).await?;
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await?;
        if answer.starts_with(b"HTTP/1.1 200") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// What every measurement of the scenario talks to.
struct Bench<'a> {
    client: &'a Client,
    args: &'a BenchArgs,
    /// The HTTP listener.
    http: std::net::SocketAddr,
    /// Of the names of the scenario's journals.
    prefix: &'a str,
}

fn scrape_tag(scraped: bool) -> &'static str {
    if scraped {
        "scraped 1/s"
    } else {
        "not scraped"
    }
}

impl Bench<'_> {
    /// 1 KiB appends at a fixed rate on a fresh journal, with /metrics
    /// scraped meanwhile or not.
    async fn latency_row(&self, round: usize, scraped: bool) -> anyhow::Result<Row> {
        let (client, args, tag) = (self.client, self.args, scrape_tag(scraped));
        let journal = format!("{}/lat-{round}-{scraped}", self.prefix);
        make_journal(client, &journal).await?;
        let scraper = scraped.then(|| Scraper::start(self.http));
        let cpu = process_cpu_secs();
        let f = crate::load::latency(client, args, journal.clone(), args.rate).await?;
        let cpu = process_cpu_secs() - cpu;
        let scrapes = scraper.map_or(0, Scraper::finish);
        eprintln!("http: latency-1k {tag} (round {round}): {scrapes} scrapes");
        let row = Row {
            what: format!("latency-1k, {tag}, round {round}"),
            appends_per_s: f.rate_achieved,
            mb_per_s: f.rate_achieved * 1024.0 / 1e6,
            p50_us: f.latency.p50_us,
            p99_us: f.latency.p99_us,
            cpu_us_per_append: cpu * 1e6 / f.completed.max(1) as f64,
        };
        client.delete(&journal).await?;
        Ok(row)
    }

    /// 1 MiB appends, several in flight, on a fresh journal, with /metrics
    /// scraped meanwhile or not.
    async fn throughput_row(&self, round: usize, scraped: bool) -> anyhow::Result<Row> {
        let (client, args, tag) = (self.client, self.args, scrape_tag(scraped));
        let journal = format!("{}/1m-{round}-{scraped}", self.prefix);
        make_journal(client, &journal).await?;
        let scraper = scraped.then(|| Scraper::start(self.http));
        let cpu = process_cpu_secs();
        let f = crate::load::throughput(
            client,
            args,
            vec![journal.clone()],
            1 << 20,
            args.append_depth,
        )
        .await?;
        let cpu = process_cpu_secs() - cpu;
        let scrapes = scraper.map_or(0, Scraper::finish);
        eprintln!("http: append-1m {tag} (round {round}): {scrapes} scrapes");
        let row = Row {
            what: format!("append-1m, {tag}, round {round}"),
            appends_per_s: f.appends_per_s,
            mb_per_s: f.mb_per_s,
            p50_us: f.latency.p50_us,
            p99_us: f.latency.p99_us,
            cpu_us_per_append: cpu * 1e6 / f.appends.max(1) as f64,
        };
        client.delete(&journal).await?;
        Ok(row)
    }

    /// 1 KiB appends from `--http-clients` closed-loop clients, `via` the
    /// native protocol or the gateway's PUT.
    async fn put_row(&self, via: &str, body: &bytes::Bytes) -> anyhow::Result<Row> {
        let (client, args, http) = (self.client, self.args, self.http);
        let journal = format!("{}/put-{via}", self.prefix);
        make_journal(client, &journal).await?;
        let start = Instant::now();
        let measure_from = start + args.warmup();
        let end = measure_from + args.duration();
        let cpu = process_cpu_secs();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..args.http_clients {
            let journal = journal.clone();
            let body = body.clone();
            if via == "native" {
                tasks.spawn(native_worker(
                    client.clone(),
                    journal,
                    body,
                    end,
                    measure_from,
                ));
            } else {
                tasks.spawn(http_worker(http, journal, body, end, measure_from));
            }
        }
        let mut h = report::histogram();
        let mut done = 0u64;
        while let Some(r) = tasks.join_next().await {
            let (wh, n) = r??;
            h.add(&wh).ok();
            done += n;
        }
        let cpu = process_cpu_secs() - cpu;
        let p = Percentiles::of(&h);
        let secs = args.duration().as_secs_f64();
        let row = Row {
            what: format!("1 KiB appends via {via}, {} clients", args.http_clients),
            appends_per_s: done as f64 / secs,
            mb_per_s: done as f64 * PUT_BYTES as f64 / secs / 1e6,
            p50_us: p.p50_us,
            p99_us: p.p99_us,
            cpu_us_per_append: cpu * 1e6 / done.max(1) as f64,
        };
        client.delete(&journal).await?;
        Ok(row)
    }
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<48} {:>12} {:>9} {:>10} {:>10} {:>14}",
        "http scenario", "appends/s", "MB/s", "p50 µs", "p99 µs", "CPU µs/append"
    );
    for r in rows {
        println!(
            "{:<48} {:>12.0} {:>9.1} {:>10.0} {:>10.0} {:>14.1}",
            r.what, r.appends_per_s, r.mb_per_s, r.p50_us, r.p99_us, r.cpu_us_per_append
        );
    }
}
