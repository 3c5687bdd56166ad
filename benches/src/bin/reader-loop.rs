//! `reader-loop`: a message reader's CPU per message against a running
//! broker, one read mode at a time, so that each mode can be profiled
//! alone.
//!
//! `reader-loop ENDPOINT committed|uncommitted [ROUNDS] [JOURNAL...]`
//! reads the journals (by default the four `bench/messages-N` journals a
//! `rotary bench --scenario messages --broker ENDPOINT` run leaves) to
//! their write heads ROUNDS times (default 5) on one thread, and prints
//! each round's CPU time per message (this thread's, from
//! `/proc/thread-self/schedstat`), as the bench's reader-CPU pass does.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use rotary_net::client::Client;
use rotary_net::message::{ReadMode, Reader, ReaderOptions};

fn thread_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    let v = s.split_whitespace().next().expect("a first field");
    v.parse().expect("a number")
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: reader-loop ENDPOINT committed|uncommitted [ROUNDS] [JOURNAL...]";
    let endpoint = args.first().ok_or_else(|| anyhow::anyhow!(usage))?.clone();
    let mode = match args.get(1).map(String::as_str) {
        Some("committed") => ReadMode::Committed,
        Some("uncommitted") => ReadMode::Uncommitted,
        _ => anyhow::bail!(usage),
    };
    let rounds: usize = args.get(2).map_or(Ok(5), |r| r.parse())?;
    let mut journals: Vec<String> = args.iter().skip(3).cloned().collect();
    if journals.is_empty() {
        journals = (0..4).map(|i| format!("bench/messages-{i}")).collect();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = Client::connect(&endpoint).await?;
        for _ in 0..rounds {
            let options = ReaderOptions {
                mode,
                ..ReaderOptions::default()
            };
            let t0 = thread_cpu_ns();
            let mut reader = Reader::open(client.clone(), &journals, options).await?;
            let mut n = 0u64;
            while let Some(env) = reader.next().await {
                std::hint::black_box(&env?);
                n += 1;
            }
            let ns = thread_cpu_ns() - t0;
            println!(
                "{mode:?}: {n} messages, {:.1} ns each",
                ns as f64 / n.max(1) as f64
            );
        }
        anyhow::Ok(())
    })
}
