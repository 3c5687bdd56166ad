//! `rotary read`: a journal's bytes to standard output, read through the
//! broker or, for history held in fragment stores, from the stores
//! directly; gaps in the history are reported on stderr, not papered over.

use super::broker::{answering, connect, BrokerArgs};
use super::exit::{ignore_broken_pipe, CliError, CmdResult};
use clap::Args;
use rotary_net::client::{Client, ClientError, ReadDone, ReadEvent};
use rotary_net::wire::{ReadRequest, OFFSET_MAX};
use rotary_net::Status;
use std::io::Write as _;

#[derive(Args, Debug)]
pub(super) struct ReadArgs {
    name: String,
    /// First offset to read, 0 to 9223372036854775807; `head` (or -1) is
    /// the write head.
    #[arg(long = "offset", default_value = "0", value_parser = parse_offset, allow_hyphen_values = true)]
    offset: ReadOffset,
    /// Stop before this offset, 1 to 9223372036854775807, and greater than
    /// --offset. Without it the read ends at the write head (or, with
    /// --block, never).
    #[arg(long = "end-offset", value_name = "N", value_parser = parse_end_offset)]
    end_offset: Option<u64>,
    /// Wait at the write head for more content (until --end-offset, if given).
    #[arg(long = "block")]
    block: bool,
    /// Print `{"offset":…,"write_head":…}` instead of content. With
    /// --block and an offset at or past the write head, waits for the
    /// commit that moves the head past it.
    #[arg(long = "metadata")]
    metadata: bool,
    /// Let the broker stream history held in fragment stores, instead of
    /// fetching those fragments from the store directly (the default).
    #[arg(long = "proxy")]
    proxy: bool,
    /// Read the --broker's own copy: it answers from what it holds (and
    /// the store) or refuses with NOT_JOURNAL_BROKER; nothing is proxied
    /// to another broker. To compare the members of a route.
    #[arg(long = "pin", conflicts_with = "proxy")]
    pin: bool,
    #[command(flatten)]
    broker: BrokerArgs,
}

#[derive(Clone, Copy, Debug)]
enum ReadOffset {
    Head,
    At(u64),
}

fn parse_offset(s: &str) -> Result<ReadOffset, String> {
    match s {
        "head" | "-1" => Ok(ReadOffset::Head),
        _ => parse_offset_number(s).map(ReadOffset::At).map_err(|e| {
            e.unwrap_or_else(|| format!("{s:?} is not an offset (a byte count, or `head`)"))
        }),
    }
}

/// A read's end. 0 would name an empty range, but on the wire it means
/// "no end": it is refused rather than read as the whole journal.
fn parse_end_offset(s: &str) -> Result<u64, String> {
    match parse_offset_number(s) {
        Ok(0) => Err(
            "the end offset must be at least 1; leave --end-offset out to read to the head".into(),
        ),
        Ok(o) => Ok(o),
        Err(e) => Err(e.unwrap_or_else(|| {
            format!("{s:?} is not an offset (a byte count, 1 to {OFFSET_MAX})")
        })),
    }
}

/// A decimal offset the wire can carry. `Err(Some(_))` names the limit;
/// `Err(None)` is not a number at all.
pub(super) fn parse_offset_number(s: &str) -> Result<u64, Option<String>> {
    let too_large = || {
        Some(format!(
            "{s} exceeds {OFFSET_MAX} (i64::MAX), the largest offset"
        ))
    };
    match s.parse::<u64>() {
        Ok(o) if o <= OFFSET_MAX => Ok(o),
        Ok(_) => Err(too_large()),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(too_large()),
        Err(_) => Err(None),
    }
}

pub(super) async fn read(args: ReadArgs) -> CmdResult {
    if let (ReadOffset::At(offset), Some(end)) = (&args.offset, args.end_offset) {
        if end <= *offset {
            return Err(CliError::Usage(
                "BAD_USAGE",
                format!("--end-offset {end} must be greater than --offset {offset}"),
            ));
        }
    }
    let req = ReadRequest {
        journal: args.name.clone(),
        offset: match args.offset {
            ReadOffset::Head => None,
            ReadOffset::At(o) => Some(o),
        },
        end_offset: args.end_offset,
        route_revision: 0,
    };
    let mut stream = open(&args, &req).await?;
    let mut out = std::io::stdout().lock();
    // Where the next byte should begin: bytes skipped over (history that
    // no fragment holds) are reported, at the start and end of the range
    // as in its middle.
    let mut next_offset: Option<u64> = req.offset;
    while let Some(event) = stream.next().await {
        match event? {
            ReadEvent::Fragment { .. } => {
                unreachable!("neither a proxied nor a direct read yields locations")
            }
            ReadEvent::Data { offset, content } => {
                if args.metadata {
                    continue;
                }
                if let Some(expected) = next_offset {
                    if offset != expected {
                        eprintln!("warning: offsets {expected}..{offset} are missing from the journal's history ({} bytes skipped)", offset - expected);
                    }
                }
                next_offset = Some(offset + content.len() as u64);
                if let Err(e) = out.write_all(&content).and_then(|_| out.flush()) {
                    // Dropping the stream cancels the read.
                    return ignore_broken_pipe(e);
                }
            }
            ReadEvent::Done(done) => {
                finish(&args, &done, next_offset, &mut out)?;
                stream.report_fallbacks();
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The read's stream: from the `--broker` alone with `--pin`, through the
/// brokers with `--proxy` or `--metadata`, else direct from the stores for
/// history they hold.
async fn open(args: &ReadArgs, req: &ReadRequest) -> Result<Reader, CliError> {
    let client = if args.pin {
        answering(Client::connect_pinned(&args.broker.endpoint()?).await?).await?
    } else {
        connect(&args.broker).await?
    };
    Ok(if args.proxy || args.metadata {
        let options = rotary_net::client::ReadOptions {
            block: args.block,
            metadata_only: args.metadata,
            do_not_proxy: args.pin,
        };
        Reader::Broker(client.read_with(req, options).await?)
    } else {
        Reader::Direct(client.read_direct(req, args.block))
    })
}

/// How the read ended: an error status, or warnings of what there was not
/// to read, and with `--metadata` the line that is the command's output.
fn finish(
    args: &ReadArgs,
    done: &ReadDone,
    next_offset: Option<u64>,
    out: &mut std::io::StdoutLock<'_>,
) -> CmdResult {
    let normal_end = done.status == Status::OK
        || (done.status == Status::OFFSET_NOT_YET_AVAILABLE && !args.block);
    if !normal_end {
        done.check()?;
    }
    if done.status == Status::OFFSET_NOT_YET_AVAILABLE && done.offset > done.write_head {
        eprintln!(
            "warning: offset {} is beyond the write head {}: nothing to read yet (--block waits for it)",
            done.offset, done.write_head
        );
    }
    if let Some(expected) = next_offset.filter(|&e| e < done.offset) {
        if done.status == Status::OK && !args.metadata {
            let found = done.offset;
            eprintln!(
                "warning: offsets {expected}..{found} are missing from the journal's history ({} bytes skipped)",
                found - expected
            );
        }
    }
    if args.metadata {
        let line = serde_json::json!({ "offset": done.offset, "write_head": done.write_head });
        out.write_all(format!("{line}\n").as_bytes())
            .and_then(|_| out.flush())
            .or_else(ignore_broken_pipe)?;
    }
    Ok(())
}

/// A proxied read (the broker streams everything) or a direct one
/// (store-held fragments fetched from the store).
enum Reader {
    Broker(rotary_net::client::ReadStream),
    Direct(rotary_net::client::DirectRead),
}

impl Reader {
    async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        match self {
            Reader::Broker(s) => s.next().await,
            Reader::Direct(s) => s.next().await,
        }
    }

    /// Says on stderr when fragments had to be read through the broker.
    fn report_fallbacks(&self) {
        if let Reader::Direct(s) = self {
            let n = s
                .stats()
                .fragments_proxied
                .load(std::sync::atomic::Ordering::Relaxed);
            if n > 0 {
                eprintln!(
                    "note: {n} fragment(s) were read through the broker: their store could not be reached from here"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets() {
        assert!(matches!(parse_offset("head"), Ok(ReadOffset::Head)));
        assert!(matches!(parse_offset("-1"), Ok(ReadOffset::Head)));
        assert!(matches!(parse_offset("42"), Ok(ReadOffset::At(42))));
        assert!(parse_offset("-2").is_err());
        // The wire carries offsets as i64: larger ones would wrap to -1.
        let max = i64::MAX.to_string();
        assert!(matches!(parse_offset(&max), Ok(ReadOffset::At(o)) if o == OFFSET_MAX));
        for big in [
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
        ] {
            let err = parse_offset(big).unwrap_err();
            assert_eq!(
                err,
                format!("{big} exceeds 9223372036854775807 (i64::MAX), the largest offset")
            );
            assert_eq!(
                super::super::append::parse_append_offset(big).unwrap_err(),
                err
            );
        }
    }

    #[test]
    fn end_offsets() {
        assert_eq!(parse_end_offset("1"), Ok(1));
        assert_eq!(parse_end_offset(&i64::MAX.to_string()), Ok(OFFSET_MAX));
        assert!(parse_end_offset("0").unwrap_err().contains("at least 1"));
        assert!(parse_end_offset("9223372036854775808")
            .unwrap_err()
            .contains("the largest offset"));
        assert!(parse_end_offset("-1")
            .unwrap_err()
            .contains("is not an offset"));
    }
}
