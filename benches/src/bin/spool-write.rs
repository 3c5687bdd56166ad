//! `spool-write`: how fast a spool's writes reach the disk in a new file
//! (grown by `fallocate`, as a spool without a spare is) and in a recycled
//! one (an earlier fragment's file, as a spool begun in a spare is), in
//! alternating pairs in one run.
//!
//! Each run stages `--mib` MiB in 4 MiB batches and writes each batch
//! before staging the next; the figure is the bytes over the time spent in
//! the writes alone (staging and hashing are left out), so it compares
//! what the disk does with the two kinds of file.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use clap::Parser;
use rotary_storage::spool::{Spool, SpoolSizing};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "spool-write",
    about = "Spool writes into new and recycled files, compared."
)]
struct Cli {
    /// Directory for the spool files (on the file system to measure).
    #[arg(long, default_value = "spool-write-bench")]
    dir: PathBuf,
    /// MiB written per run.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// Pairs of runs (new file, recycled file; the order alternates).
    #[arg(long, default_value_t = 3)]
    pairs: usize,
}

const BATCH: usize = 4 << 20;

/// Writes `mib` MiB into `spool` and seals it; returns the time spent in
/// writes and the sealed file.
async fn fill(mut spool: Spool, mib: u64, batch: &[u8]) -> anyhow::Result<(Duration, PathBuf)> {
    let mut in_writes = Duration::ZERO;
    for _ in 0..(mib << 20) / BATCH as u64 {
        spool.ensure_allocated(BATCH as u64, 0)?;
        let mut staged = 0;
        while staged < batch.len() {
            staged += spool.stage(&batch[staged..]);
        }
        let t = Instant::now();
        spool.write_staged().await?;
        in_writes += t.elapsed();
        spool.commit(spool.commit_point());
    }
    let frag = spool.seal(false).await?.expect("bytes written");
    Ok((in_writes, frag.path))
}

fn report(kind: &str, mib: u64, took: Duration) {
    println!(
        "{kind:<9} {mib} MiB in {:>7.1} ms of writes: {:>7.1} MB/s",
        took.as_secs_f64() * 1e3,
        (mib << 20) as f64 / took.as_secs_f64() / 1e6
    );
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cli.dir)?;
    let batch: Vec<u8> = (0..BATCH).map(|i| (i * 7 % 251) as u8).collect();
    let sizing = SpoolSizing::default();
    let spare = cli.dir.join("spare");
    // The first spare: a file written once.
    let first = Spool::create_sized(&cli.dir, 0, sizing).await?;
    let (_, path) = fill(first, cli.mib, &batch).await?;
    std::fs::rename(path, &spare)?;
    let mut at = 1u64 << 40;
    let (mut new_total, mut recycled_total) = (Duration::ZERO, Duration::ZERO);
    for pair in 0..cli.pairs {
        for recycled in [pair % 2 == 1, pair % 2 == 0] {
            at += 1 << 36;
            let spool = if recycled {
                Spool::create_recycled(&spare, &cli.dir, at, sizing).await?
            } else {
                Spool::create_sized(&cli.dir, at, sizing).await?
            };
            let (took, path) = fill(spool, cli.mib, &batch).await?;
            if recycled {
                recycled_total += took;
                report("recycled", cli.mib, took);
                std::fs::rename(path, &spare)?;
            } else {
                new_total += took;
                report("new", cli.mib, took);
                std::fs::remove_file(path)?;
            }
        }
    }
    std::fs::remove_file(&spare)?;
    println!(
        "recycled / new, all pairs: {:.2}",
        new_total.as_secs_f64() / recycled_total.as_secs_f64()
    );
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let rt = compio::runtime::Runtime::new().expect("runtime");
    if let Err(e) = rt.block_on(run(cli)) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
