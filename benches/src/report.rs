//! Every figure of one run, the ratios the targets ask for, and how they are
//! printed (a table) and saved (JSON).

use crate::BenchArgs;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// 1 MiB appends must reach at least this share of min(fio, iperf3).
pub const APPEND_THROUGHPUT_RATIO_MIN: f64 = 0.8;
/// 1 KiB append p99 may be at most this multiple of the ping-pong p99.
pub const LATENCY_P99_RATIO_MAX: f64 = 2.0;

/// A backfill read through `read_direct` must reach this share of a raw store GET.
pub const BACKFILL_THROUGHPUT_RATIO_MIN: f64 = 0.8;
/// Live append p99 during a backfill may be at most this multiple of it without.
pub const BACKFILL_LATENCY_RATIO_MAX: f64 = 1.2;

/// 1 MiB appends replicated to 3 brokers must reach this share of the MB/s
/// of appends that are not replicated, on the same primary.
pub const REPLICATION_THROUGHPUT_RATIO_MIN: f64 = 0.5;
/// 1 KiB append p99 replicated to 3 brokers may be at most this multiple of
/// the p99 without replication, on the same primary.
pub const REPLICATION_LATENCY_RATIO_MAX: f64 = 2.0;

/// Largest latency a histogram records; longer ones are clamped to it.
pub const LATENCY_NS_MAX: u64 = 60_000_000_000;

/// A latency histogram in nanoseconds, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3).expect("valid histogram bounds")
}

/// Records `d`, clamped to the histogram's range.
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX)
        .clamp(1, LATENCY_NS_MAX);
    h.record(ns).expect("clamped into range");
}

/// Percentiles of a latency histogram, in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Percentiles {
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        Percentiles {
            count: h.len(),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }

    fn line(&self) -> String {
        format!(
            "p50 {} · p99 {} · p99.9 {} · max {}",
            fmt_us(self.p50_us),
            fmt_us(self.p99_us),
            fmt_us(self.p999_us),
            fmt_us(self.max_us)
        )
    }
}

/// Sustained appends, several in flight (append-1m, fanout-64x4k).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ThroughputFigures {
    pub journals: usize,
    /// Journals per shard, indexed by shard.
    pub journals_per_shard: Vec<usize>,
    pub append_bytes: usize,
    /// Appends in flight per journal.
    pub depth: usize,
    pub seconds: f64,
    /// Appends that completed OK inside the measured window.
    pub appends: u64,
    pub bytes: u64,
    /// Decimal megabytes (10^6 bytes) per second.
    pub mb_per_s: f64,
    pub appends_per_s: f64,
    /// From each append's send to its reply.
    pub latency: Percentiles,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Broker counters over the scenario (warm-up included).
    pub broker_appends: Option<u64>,
    pub broker_append_bytes: Option<u64>,
    pub cross_core_forwards: Option<u64>,
}

/// Fixed-rate appends (latency-1k).
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyFigures {
    pub append_bytes: usize,
    pub rate_target: u64,
    pub seconds: f64,
    /// Appends whose intended send time fell in the measured window.
    pub sent: u64,
    pub completed: u64,
    pub rate_achieved: f64,
    /// From each append's intended send time to its reply: the figure.
    pub latency: Percentiles,
    /// From the moment the append was handed to the client to its reply.
    pub service: Percentiles,
    /// How late the pacer handed appends to the client (its own timer and
    /// scheduling delay, part of `latency`).
    pub pacer_lag: Percentiles,
    pub in_flight_max: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub cross_core_forwards: Option<u64>,
}

/// A fixed-rate phase's latency, rate and errors, on one line.
fn fixed_rate_line(l: &LatencyFigures) -> String {
    format!(
        "{} ({:.0}/s, {} errors)",
        l.latency.line(),
        l.rate_achieved,
        l.errors
    )
}

/// TCP round trips with a child process (pingpong).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PingpongFigures {
    /// unpinned, same core or cross core.
    pub placement: String,
    pub message_bytes: usize,
    pub seconds: f64,
    pub round_trips: u64,
    pub rtt: Percentiles,
}

/// One fio job's O_DIRECT sequential writes.
#[derive(Clone, Debug, Serialize)]
pub struct FioFigures {
    pub key: String,
    pub version: String,
    pub ioengine: String,
    pub block_kib: u64,
    pub iodepth: u32,
    pub file_mib: u64,
    pub mode: crate::baseline::FioMode,
    /// Each write followed by fdatasync; the latencies are the syncs'.
    pub fdatasync: bool,
    pub seconds: f64,
    pub mb_per_s: f64,
    pub iops: f64,
    pub clat_p50_us: Option<f64>,
    pub clat_p99_us: Option<f64>,
    pub clat_p999_us: Option<f64>,
    pub clat_max_us: Option<f64>,
}

/// iperf3 single-stream loopback throughput.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Iperf3Figures {
    pub version: String,
    pub seconds: f64,
    pub mb_per_s: f64,
    /// CPU iperf3 reported for its sender and its receiver together, in
    /// cores (its `cpu_utilization_percent` totals ÷ 100): what moving
    /// `mb_per_s` through loopback TCP took. Absent if it reported none.
    pub cores: Option<f64>,
}

impl Iperf3Figures {
    /// Cores one MB/s through loopback TCP took in this run.
    pub fn cores_per_mb_per_s(&self) -> Option<f64> {
        self.cores
            .filter(|c| *c > 0.0 && self.mb_per_s > 0.0)
            .map(|c| c / self.mb_per_s)
    }
}

/// SHA-1 on one core.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sha1Figures {
    pub buffer_bytes: usize,
    pub seconds: f64,
    pub mb_per_s: f64,
    /// Bytes per second hashed into two states at once, as a shard hashes
    /// each appended byte into the fragment's and the append's SHA-1.
    pub both_mb_per_s: f64,
}

impl FioFigures {
    /// E.g. `fio 16 KiB O_DIRECT extend, 32 deep`.
    pub fn describe(&self) -> String {
        let size = if self.block_kib >= 1024 && self.block_kib.is_multiple_of(1024) {
            format!("{} MiB", self.block_kib / 1024)
        } else {
            format!("{} KiB", self.block_kib)
        };
        let sync = if self.fdatasync { " + fdatasync" } else { "" };
        format!(
            "fio {size} O_DIRECT {}{sync}, {} deep",
            self.mode.name(),
            self.iodepth
        )
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub config: serde_json::Value,
    pub machine: serde_json::Value,
    pub broker: Option<serde_json::Value>,
    /// Unpinned: the floor the latency target is judged against.
    pub pingpong: Option<PingpongFigures>,
    /// Both ends pinned: on one core, and on two.
    pub pingpong_pinned: Vec<PingpongFigures>,
    pub fio: Option<FioFigures>,
    /// `fio`'s job into a fresh file preallocated by fallocate: the writes
    /// a new spool makes, where `fio` overwrites written blocks.
    pub fio_fresh: Option<FioFigures>,
    /// 4 KiB writes one at a time: the device's latency floor.
    pub fio_4k: Option<FioFigures>,
    /// `--baseline`: fio's block size × queue depth × overwrite/extend.
    pub fio_matrix: Vec<FioFigures>,
    /// `--baseline`: 4 KiB O_DIRECT writes, each followed by fdatasync.
    pub fdatasync: Option<FioFigures>,
    pub iperf3: Option<Iperf3Figures>,
    pub sha1: Option<Sha1Figures>,
    pub append_1m: Option<ThroughputFigures>,
    pub latency_1k: Option<LatencyFigures>,
    pub fanout_64x4k: Option<ThroughputFigures>,
    pub tail_readers: Option<crate::tail::TailFigures>,
    pub backfill: Option<crate::backfill::BackfillFigures>,
    pub replication: Option<crate::replication::ReplicationFigures>,
    pub failover: Option<crate::failover::Failover>,
    /// Per scenario: percent of all CPUs busy outside this process (other
    /// processes, kernel threads) while it ran.
    pub foreign_cpu_percent: Vec<(&'static str, f64)>,
    /// Per scenario: percent of all CPUs' time the host took from this
    /// virtual machine (steal) while it ran.
    pub steal_cpu_percent: Vec<(&'static str, f64)>,
    /// Figures that were not measured, and why.
    pub skipped: BTreeMap<&'static str, String>,
}

/// A ratio the targets ask for.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    pub name: &'static str,
    pub value: f64,
    pub target: String,
    pub met: bool,
}

impl Ratio {
    /// `num ÷ den` against a target it must reach; `None` without a floor
    /// to divide by.
    fn at_least(name: &'static str, num: f64, den: f64, min: f64) -> Option<Ratio> {
        (den > 0.0).then(|| {
            let value = num / den;
            Ratio {
                name,
                value,
                target: format!("≥ {min:.2}"),
                met: value >= min,
            }
        })
    }

    /// `num ÷ den` against a target it must not exceed.
    fn at_most(name: &'static str, num: f64, den: f64, max: f64) -> Option<Ratio> {
        (den > 0.0).then(|| {
            let value = num / den;
            Ratio {
                name,
                value,
                target: format!("≤ {max:.2}"),
                met: value <= max,
            }
        })
    }
}

impl Figures {
    pub fn new(args: &BenchArgs) -> Figures {
        Figures {
            config: serde_json::json!({
                "scenarios": args
                    .scenarios
                    .iter()
                    .filter_map(clap::ValueEnum::to_possible_value)
                    .map(|v| v.get_name().to_string())
                    .collect::<Vec<_>>(),
                "broker": args.broker,
                "cores": args.cores,
                "duration_secs": args.duration_secs,
                "warmup_secs": args.warmup_secs,
                "append_depth": args.append_depth,
                "rate": args.rate,
                "fanout_depth": args.fanout_depth,
                "idle_journals": args.idle_journals,
                "tail_readers": args.tail_readers,
                "backfill_gib": args.backfill_gib,
                "backfill_rate": args.backfill_rate,
                "replication_rate": args.replication_rate,
                "replication_depth": args.replication_depth,
                "pingpong_size": args.pingpong_size,
                "client_threads": args.client_threads,
                "broker_cpus": args.broker_cpus,
                "client_cpus": args.client_cpus,
                "backfill_cpus": args.backfill_cpus,
                "fio_size_mib": args.fio_size_mib,
                "fio_iodepth": args.fio_iodepth,
            }),
            machine: machine(),
            ..Figures::default()
        }
    }

    /// Records how busy the rest of the machine was during `scenario`.
    pub fn note_foreign_cpu(&mut self, scenario: &'static str, since: &crate::cpu::Sample) {
        if let Some(p) = since.foreign_percent() {
            self.foreign_cpu_percent.push((scenario, p));
        }
        if let Some(p) = since.steal_percent() {
            self.steal_cpu_percent.push((scenario, p));
        }
    }

    /// The ratios whose inputs were all measured.
    pub fn ratios(&self) -> Vec<Ratio> {
        let mut out = Vec::new();
        if let (Some(a), Some(fio), Some(net)) = (&self.append_1m, &self.fio, &self.iperf3) {
            out.extend(Ratio::at_least(
                "append-1m MB/s ÷ min(fio, iperf3) MB/s",
                a.mb_per_s,
                fio.mb_per_s.min(net.mb_per_s),
                APPEND_THROUGHPUT_RATIO_MIN,
            ));
        }
        self.latency_ratio(&mut out);
        if let Some(b) = &self.backfill {
            out.extend(Ratio::at_least(
                "backfill MB/s ÷ raw store GET MB/s",
                b.direct.mb_per_s,
                b.raw_get.mb_per_s,
                BACKFILL_THROUGHPUT_RATIO_MIN,
            ));
            out.extend(Ratio::at_most(
                "live p99 with backfill ÷ without",
                b.live_with_backfill.latency.p99_us,
                b.live_alone.latency.p99_us,
                BACKFILL_LATENCY_RATIO_MAX,
            ));
        }
        if let Some(r) = &self.replication {
            out.extend(Ratio::at_least(
                "replication 1 MiB MB/s, rep 3 ÷ rep 1",
                r.append_1m_rep3.mb_per_s,
                r.append_1m_rep1.mb_per_s,
                REPLICATION_THROUGHPUT_RATIO_MIN,
            ));
            out.extend(Ratio::at_most(
                "replication 1 KiB p99, rep 3 ÷ rep 1",
                r.latency_1k_rep3.latency.p99_us,
                r.latency_1k_rep1.latency.p99_us,
                REPLICATION_LATENCY_RATIO_MAX,
            ));
        }
        out
    }

    /// Ratios that explain a figure rather than judge it.
    pub fn bounds(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        if let (Some(a), Some(h)) = (&self.append_1m, &self.sha1) {
            if h.mb_per_s > 0.0 {
                // One journal lives on one shard, which hashes each byte
                // into two states in one interleaved pass (about 1.2 times
                // the work of one).
                out.push((
                    "append-1m MB/s ÷ SHA-1 MB/s".into(),
                    a.mb_per_s / h.mb_per_s,
                ));
            }
        }
        if let (Some(h), Some(fio), Some(net)) = (&self.sha1, &self.fio, &self.iperf3) {
            if h.both_mb_per_s > 0.0 {
                // The cores it would take only to hash the bytes of the
                // append-1m target, each into its fragment's and its
                // append's SHA-1: above this machine's core count, no
                // broker that hashes as the protocol requires reaches it.
                let target = APPEND_THROUGHPUT_RATIO_MIN * fio.mb_per_s.min(net.mb_per_s);
                let sha1 = target / h.both_mb_per_s;
                out.push((
                    "cores the append-1m target's SHA-1 alone needs".into(),
                    sha1,
                ));
                // And the cores iperf3 spent per byte moved on loopback,
                // which a client and a broker on this machine spend too
                // (one copy into the socket, one out of it). Both are
                // floors: a broker also receives into its spool, writes
                // and answers, and the load generator runs beside it.
                if let Some(tcp) = net.cores_per_mb_per_s() {
                    out.push((
                        format!(
                            "cores the append-1m target's SHA-1 and loopback TCP need (this machine has {})",
                            machine_cpus().map_or("?".into(), |n| n.to_string())
                        ),
                        sha1 + target * tcp,
                    ));
                }
            }
        }
        if let (Some(a), Some(f)) = (&self.append_1m, &self.fio_fresh) {
            if f.mb_per_s > 0.0 {
                // The journal has no store, so its spools are never begun
                // in recycled files: each append-1m byte lands on a block
                // written for the first time, which costs more than the
                // overwrite the target is set against.
                out.push((
                    format!("append-1m MB/s ÷ {}", f.describe()),
                    a.mb_per_s / f.mb_per_s,
                ));
            }
        }
        if let (Some(l), Some(f)) = (&self.latency_1k, &self.fio_4k) {
            if let Some(p99) = f.clat_p99_us.filter(|v| *v > 0.0) {
                // A replicated append waits for at least one device write.
                out.push((
                    "latency-1k p99 ÷ fio 4 KiB write p99".into(),
                    l.latency.p99_us / p99,
                ));
            }
        }
        // Against the `--baseline` device figures: the share of each that
        // rotary reached in the same run.
        for f in &self.fio_matrix {
            if f.mb_per_s <= 0.0 {
                continue;
            }
            if let (Some(a), 1024) = (&self.append_1m, f.block_kib) {
                out.push((
                    (format!("append-1m MB/s ÷ {}", f.describe())),
                    a.mb_per_s / f.mb_per_s,
                ));
            }
            if let (Some(l), Some(p99), 16, 1) = (
                &self.latency_1k,
                f.clat_p99_us.filter(|v| *v > 0.0),
                f.block_kib,
                f.iodepth,
            ) {
                out.push((
                    (format!("latency-1k p99 ÷ {} p99", f.describe())),
                    l.latency.p99_us / p99,
                ));
            }
        }
        if let Some(t) = &self.tail_readers {
            if t.alone.latency.p99_us > 0.0 {
                // "Many readers tailing one journal must not slow its
                // appends noticeably": no number is set, so it explains.
                out.push((
                    format!("tail-readers append p99, {} readers ÷ none", t.readers),
                    t.with_readers.latency.p99_us / t.alone.latency.p99_us,
                ));
            }
        }
        if let Some(a) = self.replication.as_ref().and_then(|r| r.acks_per_ack_frame) {
            // Acks the primary's pipelines received per REPLICATE_ACK frame.
            out.push(("replication acks per ack frame (rep 3)".into(), a));
        }
        if let Some(h) = self.replication.as_ref().and_then(|r| r.hop_floor.as_ref()) {
            // The crossings alone, with no broker work: the latency
            // target's ratio as this machine's placement sets it.
            for (what, a, b) in [
                ("p50", h.rep3.p50_us, h.rep1.p50_us),
                ("p99", h.rep3.p99_us, h.rep1.p99_us),
            ] {
                if b > 0.0 {
                    out.push((
                        format!("replication hop floor 1 KiB {what}, rep 3 ÷ rep 1"),
                        a / b,
                    ));
                }
            }
        }
        out
    }

    fn latency_ratio(&self, out: &mut Vec<Ratio>) {
        if let (Some(l), Some(p)) = (&self.latency_1k, &self.pingpong) {
            out.extend(Ratio::at_most(
                "latency-1k p99 ÷ pingpong p99 (unpinned)",
                l.latency.p99_us,
                p.rtt.p99_us,
                LATENCY_P99_RATIO_MAX,
            ));
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "machine": self.machine,
            "config": self.config,
            "broker": self.broker,
            "pingpong": self.pingpong,
            "pingpong_pinned": self.pingpong_pinned,
            "fio": self.fio,
            "fio_fresh": self.fio_fresh,
            "fio_4k": self.fio_4k,
            "fio_matrix": self.fio_matrix,
            "fdatasync": self.fdatasync,
            "iperf3": self.iperf3,
            "sha1": self.sha1,
            "append_1m": self.append_1m,
            "latency_1k": self.latency_1k,
            "fanout_64x4k": self.fanout_64x4k,
            "tail_readers": self.tail_readers,
            "backfill": self.backfill,
            "replication": self.replication,
            "failover": self.failover,
            "ratios": self.ratios(),
            "bounds": self.bounds().into_iter().collect::<BTreeMap<_, _>>(),
            "skipped": self.skipped,
            "foreign_cpu_percent": self.foreign_cpu_percent.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            "steal_cpu_percent": self.steal_cpu_percent.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        })
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut rows: Vec<Row> = Vec::new();
        self.baseline_rows(&mut rows);
        if let Some(t) = &self.append_1m {
            throughput_rows(&mut rows, "append-1m", t);
        }
        if let Some(l) = &self.latency_1k {
            let mut row = |f: String, v: String| rows.push(("latency-1k".into(), f, v));
            row(
                format!(
                    "{} B at {}/s, from intended send",
                    l.append_bytes, l.rate_target
                ),
                l.latency.line(),
            );
            row("from actual send".into(), l.service.line());
            row("pacer lag".into(), l.pacer_lag.line());
            row(
                "achieved rate · most in flight".into(),
                format!("{:.0}/s · {}", l.rate_achieved, l.in_flight_max),
            );
            row(
                "errors · cross-core forwards".into(),
                errors_line(l.errors, l.cross_core_forwards),
            );
        }
        if let Some(t) = &self.fanout_64x4k {
            throughput_rows(&mut rows, "fanout-64x4k", t);
        }
        if let Some(t) = &self.tail_readers {
            tail_rows(&mut rows, t);
        }
        if let Some(b) = &self.backfill {
            backfill_rows(&mut rows, b);
        }
        if let Some(r) = &self.replication {
            replication_rows(&mut rows, r);
        }
        let mut out = rows_text(&rows);
        self.summary(&mut out);
        out
    }

    /// The rows of the machine's own floors: network, disk and hashing.
    fn baseline_rows(&self, rows: &mut Vec<Row>) {
        let mut row = |s: &str, f: &str, v: String| rows.push((s.into(), f.into(), v));
        for p in self.pingpong.iter().chain(&self.pingpong_pinned) {
            row(
                "pingpong",
                &format!("TCP RTT, {} B, {}", p.message_bytes, p.placement),
                format!("{} ({} round trips)", p.rtt.line(), p.round_trips),
            );
        }
        for f in self.fio.iter().chain(&self.fio_fresh) {
            row(
                "baseline",
                &f.describe(),
                format!("{:.0} MB/s ({:.0} IOPS)", f.mb_per_s, f.iops),
            );
        }
        if let Some(f) = &self.fio_4k {
            let us = |v: Option<f64>| v.map(fmt_us).unwrap_or_else(|| "?".into());
            row(
                "baseline",
                &f.describe(),
                format!(
                    "p50 {} · p99 {} · p99.9 {} · max {}",
                    us(f.clat_p50_us),
                    us(f.clat_p99_us),
                    us(f.clat_p999_us),
                    us(f.clat_max_us)
                ),
            );
        }
        for f in self.fio_matrix.iter().chain(&self.fdatasync) {
            let us = |v: Option<f64>| v.map(fmt_us).unwrap_or_else(|| "?".into());
            row(
                "baseline",
                &f.describe(),
                format!(
                    "{:.0} MB/s · p50 {} · p99 {} · p99.9 {}",
                    f.mb_per_s,
                    us(f.clat_p50_us),
                    us(f.clat_p99_us),
                    us(f.clat_p999_us),
                ),
            );
        }
        if let Some(n) = &self.iperf3 {
            let cpu = n
                .cores
                .map(|c| format!(" · {:.0}% of a core, sender and receiver", c * 100.0))
                .unwrap_or_default();
            row(
                "baseline",
                "iperf3 loopback, 1 stream",
                format!("{:.0} MB/s{cpu}", n.mb_per_s),
            );
        }
        if let Some(h) = &self.sha1 {
            row(
                "baseline",
                &format!("SHA-1, {} B buffers, one core", h.buffer_bytes),
                format!("{:.0} MB/s", h.mb_per_s),
            );
            row(
                "baseline",
                "SHA-1 into two states at once, one core",
                format!("{:.0} MB/s", h.both_mb_per_s),
            );
        }
    }

    /// The targets, the bounds, the CPU others took and what was skipped,
    /// under the table.
    fn summary(&self, out: &mut String) {
        let ratios = self.ratios();
        if !ratios.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "targets");
            for r in ratios {
                let _ = writeln!(
                    out,
                    "  {:44} {:>6.2}   target {}   {}",
                    r.name,
                    r.value,
                    r.target,
                    if r.met { "met" } else { "missed" }
                );
            }
        }
        let bounds = self.bounds();
        if !bounds.is_empty() {
            let _ = writeln!(out);
            let _ = writeln!(out, "bounds");
            for (name, value) in bounds {
                let _ = writeln!(out, "  {name:44} {value:>6.2}");
            }
        }
        if !self.foreign_cpu_percent.is_empty() || !self.steal_cpu_percent.is_empty() {
            let _ = writeln!(out);
        }
        percent_line(
            out,
            "CPU busy outside this process (other processes, kernel threads)",
            &self.foreign_cpu_percent,
            0,
        );
        percent_line(
            out,
            "CPU time the host took from this VM (steal)",
            &self.steal_cpu_percent,
            1,
        );
        for (what, why) in &self.skipped {
            let _ = writeln!(out, "skipped {what}: {why}");
        }
    }
}

/// One row of the table: scenario, figure, value.
type Row = (String, String, String);

/// The rows in aligned columns under a header, after a blank line.
fn rows_text(rows: &[Row]) -> String {
    let w0 = rows
        .iter()
        .map(|r| r.0.chars().count())
        .max()
        .unwrap_or(0)
        .max(8);
    let w1 = rows
        .iter()
        .map(|r| r.1.chars().count())
        .max()
        .unwrap_or(0)
        .max(6);
    let mut out = String::new();
    let _ = writeln!(out);
    let _ = writeln!(out, "{:w0$}  {:w1$}  value", "scenario", "figure");
    for (s, f, v) in rows {
        let _ = writeln!(out, "{s:w0$}  {f:w1$}  {v}");
    }
    out
}

/// The rows of a closed-loop throughput scenario.
fn throughput_rows(rows: &mut Vec<Row>, name: &str, t: &ThroughputFigures) {
    let mut row = |f: String, v: String| rows.push((name.into(), f, v));
    row(
        format!(
            "{} journal(s) × {} B, {} in flight each",
            t.journals, t.append_bytes, t.depth
        ),
        format!("{:.0} MB/s · {:.0} appends/s", t.mb_per_s, t.appends_per_s),
    );
    row("append latency (closed loop)".into(), t.latency.line());
    row(
        "errors · cross-core forwards".into(),
        errors_line(t.errors, t.cross_core_forwards),
    );
}

/// The rows of the tail-readers scenario.
fn tail_rows(rows: &mut Vec<Row>, t: &crate::tail::TailFigures) {
    let mut row = |f: String, v: String| rows.push(("tail-readers".into(), f, v));
    row(
        format!(
            "{} B at {}/s, no readers",
            t.alone.append_bytes, t.alone.rate_target
        ),
        fixed_rate_line(&t.alone),
    );
    row(
        format!("{} readers tailing", t.readers),
        fixed_rate_line(&t.with_readers),
    );
    row(
        "readers whole · bytes · slowest catch-up".into(),
        format!(
            "{} of {} byte for byte to {} · {} · {:.1} ms",
            t.readers_whole, t.readers, t.head, t.reader_bytes, t.catch_up_max_ms
        ),
    );
    if let Some(e) = &t.first_reader_error {
        row("first reader error".into(), e.clone());
    }
    // Busy threads only: a run has many idle ones.
    let busy: Vec<String> = t
        .cpu_with_readers
        .iter()
        .filter(|(_, p)| **p >= 1.0)
        .map(|(name, p)| {
            let before = t.cpu_alone.get(name).copied().unwrap_or(0.0);
            format!("{name} {before:.0} → {p:.0}")
        })
        .collect();
    if !busy.is_empty() {
        row(
            "% of a core by thread, no readers → readers".into(),
            busy.join(" · "),
        );
    }
}

/// The rows of the backfill scenario.
fn backfill_rows(rows: &mut Vec<Row>, b: &crate::backfill::BackfillFigures) {
    let mut row = |f: String, v: String| rows.push(("backfill".into(), f, v));
    let mb = |r: &crate::backfill::ReadFigures| {
        format!(
            "{:.0} MB/s ({:.2} GiB in {:.1} s)",
            r.mb_per_s,
            r.bytes as f64 / (1u64 << 30) as f64,
            r.seconds
        )
    };
    row("history: 1 MiB appends".into(), mb(&b.build));
    row(
        "SEAL → every fragment uploaded".into(),
        format!("{:.1} s · {} fragments", b.upload_wait_seconds, b.fragments),
    );
    row("raw store GET (uploader reader)".into(), mb(&b.raw_get));
    row(
        "read_direct from 0".into(),
        format!(
            "{} · fetched {} · proxied {} · SHA-1 {}",
            mb(&b.direct),
            b.direct_fragments_fetched,
            b.direct_fragments_proxied,
            if b.direct_sha1_matches { "ok" } else { "WRONG" }
        ),
    );
    row(
        format!(
            "live {} B at {}/s, alone",
            b.live_alone.append_bytes, b.live_alone.rate_target
        ),
        fixed_rate_line(&b.live_alone),
    );
    row(
        "live, with backfill".into(),
        fixed_rate_line(&b.live_with_backfill),
    );
    row(
        "concurrent backfill".into(),
        format!(
            "{} · {} passes",
            mb(&b.concurrent_backfill),
            b.concurrent_backfill_passes
        ),
    );
}

fn replication_rows(rows: &mut Vec<Row>, r: &crate::replication::ReplicationFigures) {
    let mut row = |f: String, v: String| rows.push(("replication".into(), f, v));
    let threads: Vec<String> = r
        .brokers
        .iter()
        .map(|b| format!("{} {}", b.id, b.shard_threads.join(", ")))
        .collect();
    row(
        format!(
            "{} brokers × 1 shard, primary {}",
            r.brokers.len(),
            r.primary
        ),
        threads.join(" · "),
    );
    if let Some(h) = &r.hop_floor {
        let cpus: Vec<String> = h.client_cpus.iter().map(|c| c.to_string()).collect();
        for (name, p) in [("rep 1", &h.rep1), ("rep 3", &h.rep3)] {
            row(
                format!(
                    "hop floor, {name} path: {} B at {}/s (client CPUs {})",
                    h.message_bytes,
                    h.rate,
                    cpus.join(",")
                ),
                p.line(),
            );
        }
    }
    replication_phase_rows(rows, r);
    replication_counter_rows(rows, r);
}

/// The latency and throughput rows of each replication factor.
fn replication_phase_rows(rows: &mut Vec<Row>, r: &crate::replication::ReplicationFigures) {
    let mut row = |f: String, v: String| rows.push(("replication".into(), f, v));
    let phases = [
        ("rep 1", &r.append_1m_rep1, &r.latency_1k_rep1),
        ("rep 3", &r.append_1m_rep3, &r.latency_1k_rep3),
    ];
    for (name, _, l) in phases {
        row(
            format!(
                "{name}: {} B at {}/s, from intended send",
                l.append_bytes, l.rate_target
            ),
            l.latency.line(),
        );
        row(
            format!("{name}: from actual send · pacer lag p99"),
            format!("{} · {}", l.service.line(), fmt_us(l.pacer_lag.p99_us)),
        );
        row(
            format!("{name}: achieved rate · most in flight"),
            format!(
                "{:.0}/s · {} · {} errors",
                l.rate_achieved, l.in_flight_max, l.errors
            ),
        );
    }
    for (name, t, _) in phases {
        row(
            format!("{name}: {} B, {} in flight", t.append_bytes, t.depth),
            format!(
                "{:.0} MB/s · {:.0} appends/s · {} errors",
                t.mb_per_s, t.appends_per_s, t.errors
            ),
        );
        row(
            format!("{name}: append latency (closed loop)"),
            t.latency.line(),
        );
    }
}

/// The primary's counters, the first errors and the brokers' warnings.
fn replication_counter_rows(rows: &mut Vec<Row>, r: &crate::replication::ReplicationFigures) {
    let mut row = |f: String, v: String| rows.push(("replication".into(), f, v));
    let opt = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |v| v.to_string());
    row(
        "primary: acks per ack frame (rep 3)".into(),
        match r.acks_per_ack_frame {
            Some(a) => format!(
                "{a:.2} ({} acks in {} frames)",
                opt(r.repl_acks),
                opt(r.repl_ack_frames)
            ),
            None => format!(
                "unknown ({} acks in {} frames)",
                opt(r.repl_acks),
                opt(r.repl_ack_frames)
            ),
        },
    );
    for p in &r.phases {
        let cpu: Vec<String> = p
            .broker_cpu_percent
            .iter()
            .map(|(id, c)| format!("{id} {c:.0}%"))
            .collect();
        row(
            format!("{}: primary counters · broker CPU", p.phase),
            format!(
                "appends {} · replicated batches {} · syncs {} · ack frames {} · acks {} · ack polls {} ({} ms) · {}",
                opt(p.primary.appends),
                opt(p.primary.replicated_batches),
                opt(p.primary.syncs),
                opt(p.primary.repl_ack_frames),
                opt(p.primary.repl_acks),
                opt(p.primary.ack_polls),
                opt(p.primary.ack_poll_micros.map(|us| us / 1000)),
                cpu.join(" ")
            ),
        );
    }
    let first_errors = [
        ("latency-1k rep 1", &r.latency_1k_rep1.first_error),
        ("latency-1k rep 3", &r.latency_1k_rep3.first_error),
        ("append-1m rep 1", &r.append_1m_rep1.first_error),
        ("append-1m rep 3", &r.append_1m_rep3.first_error),
    ];
    for (phase, e) in first_errors {
        if let Some(e) = e {
            row(format!("{phase}: first error"), e.clone());
        }
    }
    let warnings: Vec<String> = r
        .brokers
        .iter()
        .map(|b| format!("{} {}", b.id, b.log_warnings))
        .collect();
    row(
        "broker log lines at WARN/ERROR".into(),
        warnings.join(" · "),
    );
}

fn errors_line(errors: u64, forwards: Option<u64>) -> String {
    match forwards {
        Some(f) => format!("{errors} · {f}"),
        None => format!("{errors} · unknown"),
    }
}

fn fmt_us(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us >= 100.0 {
        format!("{us:.0} µs")
    } else {
        format!("{us:.1} µs")
    }
}

/// The CPUs this process may run on.
fn machine_cpus() -> Option<usize> {
    std::thread::available_parallelism().map(|n| n.get()).ok()
}

/// What the figures were measured on.
fn machine() -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string());
    let mem_kib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<u64>().ok());
    serde_json::json!({
        "cpus": machine_cpus(),
        "cpu_model": model,
        "memory_gib": mem_kib.map(|k| (k as f64 / (1u64 << 20) as f64 * 10.0).round() / 10.0),
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "loadavg_at_start": read("/proc/loadavg").split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    })
}

/// `label: scenario p% · scenario p% …`, unless `list` is empty.
fn percent_line(out: &mut String, label: &str, list: &[(&'static str, f64)], decimals: usize) {
    if list.is_empty() {
        return;
    }
    let list: Vec<String> = list
        .iter()
        .map(|(s, p)| format!("{s} {p:.decimals$}%"))
        .collect();
    let _ = writeln!(out, "{label}: {}", list.join(" · "));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_judge_against_their_target_and_need_a_floor() {
        let r = Ratio::at_least("a", 80.0, 100.0, 0.8).unwrap();
        assert_eq!((r.value, r.met, r.target.as_str()), (0.8, true, "≥ 0.80"));
        assert!(!Ratio::at_least("a", 79.0, 100.0, 0.8).unwrap().met);
        let r = Ratio::at_most("b", 300.0, 100.0, 2.0).unwrap();
        assert_eq!((r.value, r.met, r.target.as_str()), (3.0, false, "≤ 2.00"));
        assert!(Ratio::at_most("b", 200.0, 100.0, 2.0).unwrap().met);
        assert!(Ratio::at_least("a", 1.0, 0.0, 0.8).is_none());
        assert!(Ratio::at_most("b", 1.0, 0.0, 2.0).is_none());
    }
}
