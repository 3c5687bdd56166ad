//! How a command ends: what it prints on stdout, the one line it prints on
//! stderr when it fails, and its exit code.
//!
//! Exit codes are a script's retry policy: 2 and 1 say trying again cannot
//! help, 3 says it may, and 4 says the change was made and must not be made
//! again. A broker status keeps its name; `BAD_REQUEST` counts as bad input.

use rotary_net::client::ClientError;
use rotary_net::Status;
use std::io::Write as _;

pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_RETRYABLE: i32 = 3;
/// The command's change was made but its result could not be written out:
/// a script must not retry it.
pub const EXIT_CHANGED_UNREPORTED: i32 = 4;

/// A failed command: what to print and how to exit.
#[derive(Debug)]
pub enum CliError {
    /// The broker or the client library reported an error.
    Client(ClientError),
    /// Bad input from the user (exit 2): `(STATUS_NAME, explanation)`.
    Usage(&'static str, String),
    /// Anything else (exit 1).
    Other(&'static str, anyhow::Error),
    /// The command changed something (`what`) and then could not write its
    /// result (exit 4).
    ChangedUnreported { what: String, error: anyhow::Error },
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError::Client(e)
    }
}

/// An error and its causes, `a: b: c`, leaving out a cause whose text the
/// message before it already carries (many errors print their source).
fn chain_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.is_empty() {
            text = c;
        } else if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl CliError {
    /// Prints the error's line on stderr; returns the exit code.
    pub(super) fn report(&self) -> i32 {
        let (name, text, code) = self.parts();
        eprintln!("error: {name}: {}", one_line(&text));
        code
    }

    /// The status name, the explanation and the exit code.
    fn parts(&self) -> (&str, String, i32) {
        match self {
            CliError::Client(e) => client_parts(e),
            CliError::Usage(name, text) => (name, text.clone(), EXIT_USAGE),
            CliError::Other(name, e) => (name, chain_text(e), EXIT_FAILED),
            CliError::ChangedUnreported { what, error } => (
                "OUTPUT_ERROR_AFTER_CHANGE",
                format!("{what}, but {}: do not retry", chain_text(error)),
                EXIT_CHANGED_UNREPORTED,
            ),
        }
    }
}

/// [`CliError::parts`] of an error of the broker or the client library.
fn client_parts(e: &ClientError) -> (&str, String, i32) {
    match e {
        ClientError::Status {
            status, message, ..
        } => {
            let code = status_exit_code(*status);
            let text = if message.is_empty() {
                status_explanation(*status).to_string()
            } else {
                message.clone()
            };
            (status.name(), text, code)
        }
        ClientError::Io { .. } => ("UNAVAILABLE", e.to_string(), EXIT_RETRYABLE),
        ClientError::Protocol { .. } => ("PROTOCOL_ERROR", e.to_string(), EXIT_FAILED),
        ClientError::Invalid(inner) => ("BAD_REQUEST", inner.to_string(), EXIT_USAGE),
        ClientError::Offset(inner) => ("BAD_REQUEST", inner.to_string(), EXIT_USAGE),
        ClientError::Content(inner) => (
            "INPUT_ERROR",
            format!("reading content: {inner}"),
            EXIT_FAILED,
        ),
        ClientError::Fragment(inner) => ("FRAGMENT_CORRUPT", inner.to_string(), EXIT_FAILED),
    }
}

/// A broker status's exit code: `BAD_REQUEST` is what the command line
/// asked for (an empty append with register changes, a spec the broker
/// refuses), so it exits like every other invalid input; retryable
/// statuses exit 3 so that scripts know to try again.
fn status_exit_code(status: Status) -> i32 {
    if status == Status::BAD_REQUEST {
        EXIT_USAGE
    } else if status.is_retryable() {
        EXIT_RETRYABLE
    } else {
        EXIT_FAILED
    }
}

fn status_explanation(status: Status) -> &'static str {
    match status {
        Status::JOURNAL_NOT_FOUND => "no journal of that name exists",
        Status::NOT_ALLOWED => "the journal's flags forbid this",
        Status::WRONG_APPEND_OFFSET => "the write head is not at the expected offset",
        Status::REGISTER_MISMATCH => "the journal's registers do not match",
        Status::OFFSET_NOT_YET_AVAILABLE => "the offset is at or beyond the write head",
        Status::INDEX_HAS_GREATER_OFFSET => {
            "the fragment stores hold history beyond the write head; run `rotary journals reset-head`"
        }
        Status::FRAGMENT_STORE_UNHEALTHY => {
            "a fragment store of the journal cannot be reached or uploads are behind"
        }
        Status::DISK_FAILED => {
            "the broker's disk failed under the journal; append elsewhere, or after the disk is replaced"
        }
        _ => "the broker refused the request",
    }
}

pub(crate) type CmdResult = Result<(), CliError>;

pub(super) fn print_text(text: &str) -> CmdResult {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .or_else(ignore_broken_pipe)
}

pub(super) fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    let mut text = serde_json::to_string_pretty(v).expect("JSON");
    text.push('\n');
    print_text(&text)
}

pub(crate) fn ignore_broken_pipe(e: std::io::Error) -> CmdResult {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(CliError::Other(
            "OUTPUT_ERROR",
            anyhow::Error::new(e).context("writing standard output"),
        ))
    }
}

/// The result of printing what a command changed: an output error then says
/// that the change was made, so that nobody retries it.
pub(super) fn after_change(printed: CmdResult, what: impl FnOnce() -> String) -> CmdResult {
    match printed {
        Err(CliError::Other("OUTPUT_ERROR", error)) => Err(CliError::ChangedUnreported {
            what: what(),
            error,
        }),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chains_name_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = anyhow::Error::new(std::io::Error::other(format!("cannot listen: {io}")));
        assert_eq!(chain_text(&e), format!("cannot listen: {io}"));
        let e = anyhow::Error::new(io).context("starting");
        assert_eq!(chain_text(&e), "starting: address in use");
    }

    #[test]
    fn status_exit_codes() {
        assert_eq!(status_exit_code(Status::BAD_REQUEST), EXIT_USAGE);
        assert_eq!(status_exit_code(Status::JOURNAL_NOT_FOUND), EXIT_FAILED);
        assert_eq!(status_exit_code(Status::WRONG_APPEND_OFFSET), EXIT_FAILED);
        assert_eq!(status_exit_code(Status::STORAGE_FULL), EXIT_RETRYABLE);
        assert_eq!(status_exit_code(Status::IO_ERROR), EXIT_RETRYABLE);
        assert_eq!(status_exit_code(Status::DISK_FAILED), EXIT_FAILED);
    }
}
