//! `spec-changes`: what one change of specs costs the thread that makes it,
//! in a spec store that holds many journals.
//!
//! Fills a new store with `--journals` specs in changes of 10,000 (as
//! `rotary journals apply -f` of large files would), then makes
//! `--changes` changes of one spec each, as a client's APPLY does on the
//! shard that takes it, and times each from call to return: the time that
//! shard would serve nothing. Prints the percentiles and the slowest
//! changes, and the change logs and snapshot on disk at the end.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use clap::Parser;
use hdrhistogram::Histogram;
use rotary_engine::specs::SpecStore;
use rotary_net::spec::{JournalSpec, LabelSet};
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser, Debug)]
#[command(
    name = "spec-changes",
    about = "Time changes of one spec in a store of many."
)]
struct Cli {
    /// Directory for the store (emptied first; on the file system to measure).
    #[arg(long, default_value = "spec-changes-bench")]
    dir: PathBuf,
    /// Specs in the store before the timed changes.
    #[arg(long, default_value_t = 60_000)]
    journals: usize,
    /// Timed changes of one spec each.
    #[arg(long, default_value_t = 20_000)]
    changes: usize,
}

fn spec(i: usize, round: usize) -> JournalSpec {
    let mut spec = JournalSpec::new(format!("many/part-{i:05}"));
    let round = format!("r{round}");
    spec.labels =
        LabelSet::from_pairs([("app", "many"), ("round", round.as_str())]).expect("valid labels");
    spec.fragment.stores = vec!["file:///tmp/scale/store/".into()];
    spec
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as u64
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = std::fs::remove_dir_all(&cli.dir);
    std::fs::create_dir_all(&cli.dir)?;
    let store = SpecStore::open(cli.dir.join("specs.json"))?;
    let filled = Instant::now();
    for start in (0..cli.journals).step_by(10_000) {
        let batch = (start..cli.journals.min(start + 10_000))
            .map(|i| spec(i, 0))
            .collect();
        store.apply_at(batch, now_nanos())?;
    }
    println!(
        "filled {} specs in {:.2} s",
        cli.journals,
        filled.elapsed().as_secs_f64()
    );
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut slowest: Vec<(u64, usize)> = Vec::new();
    let run = Instant::now();
    for n in 0..cli.changes {
        let t = Instant::now();
        store.apply_at(vec![spec(n % cli.journals, n + 1)], now_nanos())?;
        let ns = t.elapsed().as_nanos() as u64;
        hist.record(ns.max(1))?;
        slowest.push((ns, n));
    }
    let took = run.elapsed();
    slowest.sort_unstable_by(|a, b| b.cmp(a));
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    println!(
        "{} changes of one spec in {:.2} s: p50 {:.1} µs · p99 {:.1} µs · p99.9 {:.1} µs · max {:.1} ms",
        cli.changes,
        took.as_secs_f64(),
        us(0.5),
        us(0.99),
        us(0.999),
        hist.max() as f64 / 1e6
    );
    let top: Vec<String> = slowest
        .iter()
        .take(5)
        .map(|(ns, n)| format!("#{n} {:.1} ms", *ns as f64 / 1e6))
        .collect();
    println!("slowest: {}", top.join(" · "));
    drop(store);
    let mut files: Vec<(String, u64)> = std::fs::read_dir(&cli.dir)?
        .map(|e| {
            let e = e?;
            Ok((
                e.file_name().to_string_lossy().into_owned(),
                e.metadata()?.len(),
            ))
        })
        .collect::<std::io::Result<_>>()?;
    files.sort();
    let files: Vec<String> = files
        .iter()
        .map(|(name, len)| format!("{name} {:.1} MB", *len as f64 / 1e6))
        .collect();
    println!("on disk: {}", files.join(" · "));
    std::fs::remove_dir_all(&cli.dir)?;
    Ok(())
}
