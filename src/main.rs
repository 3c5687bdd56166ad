//! `rotary`: the broker (`rotary serve`) and the command-line client.
//!
//! Client commands talk to a broker with `rotary_net::client`. Errors print
//! one line, `error: <STATUS_NAME>: <explanation>`, on stderr. Exit codes:
//! 0 success, 1 a non-retryable status or other failure, 2 bad usage or
//! invalid input (`BAD_REQUEST` from the broker included), 3 a retryable
//! status (or the broker could not be reached). README.md lists the names
//! that are the CLI's own, with their exit codes; keep it in step with
//! `cli::CliError::report`.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

mod cli;
mod output;

use clap::Parser;

fn main() {
    rotary_engine::tune_allocator();
    let args = cli::Cli::parse();
    let code = cli::run(args);
    std::process::exit(code);
}
