//! `rotary-bench`: the benchmark harness on its own, with the same flags as
//! `rotary bench`.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "rotary-bench",
    version,
    about = "Benchmarks one rotary broker against this machine's disk and loopback floors."
)]
struct Cli {
    #[command(flatten)]
    bench: rotary_benches::BenchArgs,
}

fn main() {
    rotary_engine::tune_allocator();
    let cli = Cli::parse();
    if let Err(e) = rotary_benches::run(cli.bench) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
