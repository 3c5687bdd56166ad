//! The command line: its tree of commands, and which module runs each.
//!
//! `serve`, `doctor`, `tune` and `bench` run on the calling thread; the
//! client commands talk to a broker (`rotary_net::client`) on a
//! current-thread runtime started here, one module per job: [`journals`]
//! and [`brokers`] administer the cluster, [`append`] and [`read`] move a
//! journal's bytes, [`messages`] publishes and consumes messages. Every
//! command ends in success or a [`CliError`], which [`exit`] prints and
//! turns into the process's exit code.

mod append;
mod broker;
mod brokers;
mod exit;
mod journals;
mod messages;
mod read;
mod serve;

pub use exit::CliError;
use exit::{one_line, CmdResult, EXIT_FAILED, EXIT_OK};

use broker::BrokerArgs;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "rotary",
    version,
    about = "A streaming journal broker: append-only byte journals."
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs a broker until SIGINT or SIGTERM.
    Serve(Box<serve::ServeArgs>),
    /// Creates, lists, deletes and seals journals.
    Journals {
        #[command(subcommand)]
        cmd: journals::JournalsCmd,
    },
    /// Lists the cluster's brokers, or drains one.
    Brokers {
        #[command(subcommand)]
        cmd: brokers::BrokersCmd,
    },
    /// Appends standard input (or a file) to a journal as one atomic span and
    /// prints the result as one JSON line.
    Append(append::AppendArgs),
    /// Reads a journal's bytes to standard output.
    Read(read::ReadArgs),
    /// Publishes JSON lines from standard input as messages
    /// (docs/MESSAGES.md), to the journals in turn.
    Publish(messages::PublishArgs),
    /// Prints the messages of journals, one per line: read committed
    /// (each committed message once), or everything with --uncommitted.
    Consume(messages::ConsumeArgs),
    /// Lists a journal's fragments, with their states: open, uploading,
    /// uploaded, local, stored, damaged, and for store fragments that
    /// disagree with another over the same offsets, conflicting (not the
    /// journal's history: never served, removed by `journals prune`) or
    /// disputed (not known to be: reads of its span are refused).
    Fragments {
        name: String,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Prints the broker's counters as JSON.
    Stats {
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Checks this host for what a broker needs.
    Doctor {
        /// Data directory to check.
        #[arg(long = "data", default_value = "./rotary-data")]
        data: PathBuf,
    },
    /// Load-tests a broker and measures this machine's floors in the same
    /// run (docs/BENCHMARKS.md).
    Bench(Box<rotary_benches::BenchArgs>),
    /// Calibrates the data directory's device and writes
    /// <data>/tune-profile.json, which `serve` reads at start.
    Tune {
        /// Data directory whose device is calibrated.
        #[arg(long = "data", default_value = "./rotary-data")]
        data: PathBuf,
        /// About 5 s instead of 20-25 s; coarser.
        #[arg(long)]
        quick: bool,
    },
}

/// `-o` of the commands that print a table or JSON.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum TableOrJson {
    Table,
    Json,
}

/// Runs a parsed command line; returns the process exit code.
pub fn run(cli: Cli) -> i32 {
    let result = match cli.cmd {
        Cmd::Serve(args) => serve::serve(*args),
        Cmd::Doctor { data } => return rotary_tuning::doctor::run(&data),
        Cmd::Tune { data, quick } => return tune(&data, quick),
        Cmd::Bench(args) => {
            return match rotary_benches::run(*args) {
                Ok(()) => EXIT_OK,
                Err(e) => {
                    eprintln!("error: BENCH_FAILED: {}", one_line(&format!("{e:#}")));
                    EXIT_FAILED
                }
            }
        }
        other => {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    return CliError::Other(
                        "RUNTIME_FAILED",
                        anyhow::Error::new(e).context("starting the runtime"),
                    )
                    .report()
                }
            };
            rt.block_on(client_command(other))
        }
    };
    match result {
        Ok(()) => EXIT_OK,
        Err(e) => e.report(),
    }
}

async fn client_command(cmd: Cmd) -> CmdResult {
    match cmd {
        Cmd::Serve(_) | Cmd::Doctor { .. } | Cmd::Tune { .. } | Cmd::Bench(_) => {
            unreachable!("handled without a runtime")
        }
        Cmd::Journals { cmd } => journals::journals(cmd).await,
        Cmd::Brokers { cmd } => brokers::brokers(cmd).await,
        Cmd::Append(args) => append::append(args).await,
        Cmd::Read(args) => read::read(args).await,
        Cmd::Publish(args) => messages::publish(args).await,
        Cmd::Consume(args) => messages::consume(args).await,
        Cmd::Fragments {
            name,
            output,
            broker,
        } => journals::fragments(&name, output, &broker).await,
        Cmd::Stats { broker } => brokers::stats(&broker).await,
    }
}

fn tune(data: &std::path::Path, quick: bool) -> i32 {
    use rotary_tuning::tune::{self, TuneOptions};
    let base = if quick {
        TuneOptions::quick()
    } else {
        TuneOptions::standard()
    };
    let opts = TuneOptions {
        progress: true,
        ..base
    };
    match tune::run(data, &opts).and_then(|p| p.save(data)) {
        Ok(path) => {
            println!("wrote {}", path.display());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("error: TUNE_FAILED: {}", one_line(&e.to_string()));
            EXIT_FAILED
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_shapes_parse() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        for line in [
            "rotary serve --data /tmp/d --listen 127.0.0.1:7401 --cores 2 --disk-reserve 1G",
            "rotary serve --spool-budget 64M --upload-threads 4",
            "rotary serve --cluster c.yaml --id b1 --cpus 0,2-3",
            "rotary journals reset-head a/b/c",
            "rotary journals prune -l app=orders --dry-run -o json",
            "rotary journals prune",
            "rotary read a/b/c --proxy --block",
            "rotary read a/b/c --pin --metadata --broker 127.0.0.1:7411",
            "rotary journals apply -f -",
            "rotary journals list -l app=orders -o yaml --broker 127.0.0.1:1",
            "rotary journals delete a/b/c",
            "rotary journals seal a/b/c",
            "rotary append a/b/c -i /tmp/x --offset 5 --check-registers owner=a --union-registers k=v,k2=v2 --subtract-registers k",
            "rotary read a/b/c --offset 10 --end-offset 20 --block",
            "rotary read a/b/c --offset head --metadata",
            "rotary fragments a/b/c -o json",
            "rotary stats",
            "rotary doctor --data /tmp/d",
        ] {
            let words: Vec<&str> = line.split_whitespace().collect();
            Cli::try_parse_from(words).unwrap_or_else(|e| panic!("{line}: {e}"));
        }
    }
}
