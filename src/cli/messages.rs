//! `rotary publish` and `rotary consume`: messages on journals from the
//! shell (docs/MESSAGES.md).
//!
//! `publish` reads JSON lines from standard input and publishes each as a
//! message, to the journals named in turn (round robin); with `--txn` all of
//! them form one transaction, committed at end of input (and rolled back if
//! the input is bad). `consume` prints each message on one line:
//! read-committed by default, everything with `--uncommitted`.
//! Acknowledgements carry no content and are not printed.

use super::broker::{connect, BrokerArgs};
use super::exit::{ignore_broken_pipe, CliError, CmdResult};
use clap::Args;
use rotary_net::client::ClientError;
use rotary_net::message::{
    MessageError, Publisher, PublisherOptions, ReadMode, Reader, ReaderOptions,
};
use std::io::Write as _;
use std::time::Duration;
use tokio::io::AsyncBufReadExt as _;

/// Longest input line `publish` takes.
pub const PUBLISH_LINE_LEN_MAX: usize = 16 << 20;

#[derive(Args, Debug)]
pub struct PublishArgs {
    /// Journals to publish to, in turn; each needs a `content-type` label
    /// (`application/x-ndjson` or `application/x-protobuf-fixed`).
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
    /// Publish every line as one transaction, committed at end of input.
    #[arg(long = "txn")]
    txn: bool,
    /// How long an append whose outcome is unknown (or that was refused
    /// with a retryable status) is tried again, in seconds.
    #[arg(long = "retry-secs", value_name = "SECS", default_value_t = 120)]
    retry_secs: u64,
    #[command(flatten)]
    broker: BrokerArgs,
}

#[derive(Args, Debug)]
pub struct ConsumeArgs {
    /// Journals to read.
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
    /// Print every message as it is in the journals: duplicates and
    /// messages of transactions not (or never) committed included.
    #[arg(long = "uncommitted")]
    uncommitted: bool,
    /// Offset to start every journal at, 0 to 9223372036854775807 (a
    /// message boundary).
    #[arg(long = "offset", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=rotary_net::wire::OFFSET_MAX))]
    offset: u64,
    /// Wait at the write heads for more messages.
    #[arg(long = "block")]
    block: bool,
    #[command(flatten)]
    broker: BrokerArgs,
}

/// A message-layer error as the CLI reports it: broker statuses keep their
/// names and exit codes; an append given up on with its outcome unknown is
/// UNAVAILABLE (exit 3); the rest is invalid input or a failure.
fn cli_error(e: MessageError) -> CliError {
    match e {
        MessageError::Client(c) => CliError::Client(c),
        MessageError::Append {
            journal,
            why,
            status: Some(status),
            ..
        } => CliError::Client(ClientError::Status {
            status,
            message: format!("{journal}: {why}"),
            append_reply: None,
        }),
        e @ (MessageError::Append { .. } | MessageError::Poisoned { .. }) => {
            CliError::Client(ClientError::Io {
                endpoint: String::new(),
                source: std::sync::Arc::new(std::io::Error::other(format!(
                    "{e}; its messages may or may not have been appended"
                ))),
            })
        }
        MessageError::JournalNotFound { journal } => CliError::Client(ClientError::Status {
            status: rotary_net::Status::JOURNAL_NOT_FOUND,
            message: format!("{journal}: no such journal"),
            append_reply: None,
        }),
        e @ (MessageError::NoFraming { .. }
        | MessageError::BadPointer { .. }
        | MessageError::BadPayload { .. }
        | MessageError::BadUuid { .. }
        | MessageError::BadProducer { .. }
        | MessageError::MixedTransaction { .. }
        | MessageError::BadCheckpoint { .. }) => CliError::Usage("BAD_REQUEST", e.to_string()),
        e @ MessageError::Replay { .. } => CliError::Other("PROTOCOL_ERROR", e.into()),
        MessageError::Journals(errors) => several(errors),
    }
}

/// Failures of several journals: reported as the first one is, with a
/// message naming them all.
fn several(errors: Vec<MessageError>) -> CliError {
    let all = errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let Some(first) = errors.into_iter().next() else {
        return CliError::Other("PROTOCOL_ERROR", anyhow::anyhow!("no failure given"));
    };
    match cli_error(first) {
        CliError::Client(ClientError::Status {
            status,
            append_reply,
            ..
        }) => CliError::Client(ClientError::Status {
            status,
            message: all,
            append_reply,
        }),
        other => other,
    }
}

pub async fn publish(args: PublishArgs) -> CmdResult {
    let client = connect(&args.broker).await?;
    let options = PublisherOptions {
        retry_for: Duration::from_secs(args.retry_secs),
        ..PublisherOptions::default()
    };
    let mut publisher = Publisher::new(client, options);
    for name in &args.names {
        publisher.prepare(name).await.map_err(cli_error)?;
    }
    let count = match publish_lines(&args, &mut publisher).await {
        Ok(count) => count,
        Err(e) => {
            settle_bad_input(&args, &mut publisher).await;
            return Err(e);
        }
    };
    let done = if args.txn {
        publisher.commit().await
    } else {
        publisher.flush().await
    };
    done.map_err(cli_error)?;
    print_summary(&publisher, count)
}

/// Publishes each line of standard input, to the journals in turn, until
/// the input ends (then the count of messages) or a line is bad.
async fn publish_lines(args: &PublishArgs, publisher: &mut Publisher) -> Result<u64, CliError> {
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).split(b'\n');
    let mut count: u64 = 0;
    let mut line_no: u64 = 0;
    loop {
        let line = match lines.next_segment().await {
            Ok(Some(l)) => l,
            Ok(None) => return Ok(count),
            Err(e) => {
                return Err(CliError::Other(
                    "INPUT_ERROR",
                    anyhow::Error::new(e).context("reading standard input"),
                ))
            }
        };
        line_no += 1;
        let line = line.strip_suffix(b"\r").unwrap_or(&line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if line.len() > PUBLISH_LINE_LEN_MAX {
            return Err(CliError::Usage(
                "BAD_REQUEST",
                format!("line {line_no}: longer than {PUBLISH_LINE_LEN_MAX} bytes"),
            ));
        }
        let journal = &args.names[(count % args.names.len() as u64) as usize];
        let r = if args.txn {
            publisher.publish_uncommitted(journal, line).await
        } else {
            publisher.publish_committed(journal, line).await
        };
        match r {
            Ok(_) => count += 1,
            Err(MessageError::BadPayload { why }) => {
                return Err(CliError::Usage(
                    "BAD_REQUEST",
                    format!("line {line_no}: {why}"),
                ))
            }
            Err(e) => return Err(cli_error(e)),
        }
    }
}

/// After bad input: nothing of a transaction commits; lines before a bad
/// one outside a transaction are published.
async fn settle_bad_input(args: &PublishArgs, publisher: &mut Publisher) {
    let done = if args.txn {
        publisher.rollback().await
    } else {
        publisher.flush().await
    };
    if let Err(e2) = done {
        let what = if args.txn {
            "rolling back"
        } else {
            "publishing the lines before it"
        };
        eprintln!("warning: {what}: {e2}");
    }
}

/// The line `publish` prints once everything is committed.
fn print_summary(publisher: &Publisher, count: u64) -> CmdResult {
    let summary = serde_json::json!({
        "messages": count,
        "producer": publisher.producer().to_hex(),
        "clock": publisher.clock().0,
        "committed": true,
    });
    let mut text = summary.to_string();
    text.push('\n');
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .or_else(ignore_broken_pipe)
}

pub async fn consume(args: ConsumeArgs) -> CmdResult {
    let client = connect(&args.broker).await?;
    let options = ReaderOptions {
        mode: if args.uncommitted {
            ReadMode::Uncommitted
        } else {
            ReadMode::Committed
        },
        block: args.block,
        offset: args.offset,
        ..ReaderOptions::default()
    };
    let mut reader = Reader::open(client, &args.names, options)
        .await
        .map_err(cli_error)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut result = Ok(());
    while let Some(next) = reader.next().await {
        let env = match next {
            Ok(env) => env,
            Err(e) => {
                result = Err(cli_error(e));
                break;
            }
        };
        if env.is_ack() {
            continue;
        }
        let mut w = out.write_all(&env.message);
        if !env.message.ends_with(b"\n") {
            w = w.and_then(|_| out.write_all(b"\n"));
        }
        if args.block {
            w = w.and_then(|_| out.flush());
        }
        if let Err(e) = w {
            return ignore_broken_pipe(e);
        }
    }
    out.flush().or_else(ignore_broken_pipe)?;
    for name in &args.names {
        let skipped = reader.skipped_bytes(name);
        if skipped > 0 {
            eprintln!("warning: {name}: skipped {skipped} bytes of damaged frames");
        }
    }
    result
}
