//! `rotary append`: standard input (or a file) appended to a journal as one
//! atomic span, with the journal's registers checked and changed in the
//! same commit. Content that fits in memory is retried while the journal's
//! route moves; longer content is streamed once.

use super::broker::{connect, BrokerArgs};
use super::exit::{after_change, print_text, CliError, CmdResult};
use super::read::parse_offset_number;
use clap::Args;
use rotary_net::client::{Client, ClientError};
use rotary_net::spec::{LabelSelector, LabelSet, SpecError};
use rotary_net::wire::{AppendRequest, OFFSET_MAX};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub(super) struct AppendArgs {
    name: String,
    /// Read content from this file instead of standard input (`-` is
    /// standard input).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: Option<PathBuf>,
    /// Commit only if the journal's write head is exactly this offset, 0
    /// to 9223372036854775807 (0: only into an empty journal). Without it
    /// the append commits at the write head, wherever that is.
    #[arg(long = "offset", value_name = "N", value_parser = parse_append_offset, allow_hyphen_values = true)]
    offset: Option<u64>,
    /// Commit only if the journal's registers match this selector.
    #[arg(long = "check-registers", value_name = "SELECTOR")]
    check_registers: Option<String>,
    /// Registers to set when the append commits, `k=v,k2=v2`: each name
    /// given gets exactly these values, replacing those it had. Applied
    /// after --subtract-registers.
    #[arg(long = "union-registers", value_name = "K=V,...")]
    union_registers: Option<String>,
    /// Registers to remove when the append commits, `k=v,...`: a name is
    /// removed when its values are exactly those given (`k` alone is the
    /// empty value, which removes only an empty `k`).
    #[arg(long = "subtract-registers", value_name = "K=V,...")]
    subtract_registers: Option<String>,
    #[command(flatten)]
    broker: BrokerArgs,
}

/// An append's expected write head. The wire's `-1` (no expectation) is
/// what leaving `--offset` out sends, so negative values are refused
/// rather than taken to mean "the head" as they do for `read`.
pub(super) fn parse_append_offset(s: &str) -> Result<u64, String> {
    if s.starts_with('-') {
        return Err(format!(
            "append takes the write head it expects, 0 to {OFFSET_MAX}; \
             to append wherever the head is, leave --offset out"
        ));
    }
    parse_offset_number(s).map_err(|e| {
        e.unwrap_or_else(|| format!("{s:?} is not an offset (a byte count, 0 to {OFFSET_MAX})"))
    })
}

/// Parses `k=v,k2=v2` (or `k` for an empty value) into a label set.
fn parse_label_set(text: &str) -> Result<LabelSet, SpecError> {
    let mut set = LabelSet::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (n, v) = part.split_once('=').unwrap_or((part, ""));
        set.add(n.trim().to_string(), v.trim().to_string())?;
    }
    Ok(set)
}

pub(super) async fn append(args: AppendArgs) -> CmdResult {
    let req = request(&args)?;
    let input = match &args.input {
        // `-i -` is standard input, as `apply -f -` is.
        Some(path) if path.as_os_str() == "-" => None,
        Some(path) => Some(tokio::fs::File::open(path).await.map_err(|e| {
            CliError::Usage("BAD_USAGE", format!("opening {}: {e}", path.display()))
        })?),
        None => None,
    };
    let client = connect(&args.broker).await?;
    let reply = match input {
        Some(file) => append_input(&client, &req, file).await?,
        None => append_input(&client, &req, tokio::io::stdin()).await?,
    };
    let line = serde_json::json!({
        "journal": args.name,
        "begin": reply.begin,
        "end": reply.end,
        "sha1": hex::encode(reply.sha1),
        "registers": reply.registers,
    });
    after_change(print_text(&format!("{line}\n")), || {
        format!("the append committed: {line}")
    })
}

/// The append the flags ask for; a selector or label set the broker would
/// refuse is bad input, found before connecting.
fn request(args: &AppendArgs) -> Result<AppendRequest, CliError> {
    let bad = |e: SpecError| CliError::Usage("BAD_REQUEST", e.to_string());
    Ok(AppendRequest {
        journal: args.name.clone(),
        expect_offset: args.offset,
        check_registers: match &args.check_registers {
            Some(t) => LabelSelector::parse(t).map_err(bad)?,
            None => LabelSelector::default(),
        },
        union_registers: match &args.union_registers {
            Some(t) => parse_label_set(t).map_err(bad)?,
            None => LabelSet::new(),
        },
        subtract_registers: match &args.subtract_registers {
            Some(t) => parse_label_set(t).map_err(bad)?,
            None => LabelSet::new(),
        },
        route_revision: 0,
    })
}

/// Append content a CLI append reads into memory, so that it can be tried
/// again; longer content is streamed as it is read, and not retried.
const APPEND_RETRY_BUFFER_MAX: usize = 16 << 20;

/// Appends what `input` yields: whole, with retries, if it ends within
/// [`APPEND_RETRY_BUFFER_MAX`]; else streamed.
async fn append_input<R>(
    client: &Client,
    req: &AppendRequest,
    mut input: R,
) -> Result<rotary_net::wire::AppendReply, CliError>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    (&mut input)
        .take(APPEND_RETRY_BUFFER_MAX as u64 + 1)
        .read_to_end(&mut head)
        .await
        .map_err(|e| CliError::Client(ClientError::Content(e)))?;
    if head.len() <= APPEND_RETRY_BUFFER_MAX {
        return Ok(client.append(req, head).await?);
    }
    let rest = std::io::Cursor::new(head).chain(input);
    Ok(client.append_stream(req, rest).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_sets_from_text() {
        let set = parse_label_set("owner=a, epoch=2,flag").unwrap();
        assert_eq!(set.to_text(), "epoch=2,flag,owner=a");
        assert!(parse_label_set("bad name=x").is_err());
    }

    #[test]
    fn append_offsets() {
        let max = i64::MAX.to_string();
        assert_eq!(parse_append_offset("0"), Ok(0));
        assert_eq!(parse_append_offset(&max), Ok(OFFSET_MAX));
        for negative in ["-1", "-2"] {
            let err = parse_append_offset(negative).unwrap_err();
            assert!(err.contains("leave --offset out"), "{err}");
        }
        assert!(parse_append_offset("head")
            .unwrap_err()
            .contains("is not an offset"));
    }
}
