//! The broker a client command talks to: the flags every such command takes
//! (`--broker`, `--retry-for`) with their environment variables, and the
//! connection, made only once the broker answers.

use super::exit::CliError;
use clap::Args;
use rotary_net::client::{Client, ClientError};

/// Default broker endpoint of client commands.
pub const BROKER_DEFAULT: &str = "127.0.0.1:7401";
/// Environment variable naming the broker endpoint.
pub const BROKER_ENV: &str = "ROTARY_BROKER";

#[derive(Args, Debug)]
pub(crate) struct BrokerArgs {
    /// How long an append, or a read (not --proxy or --metadata), keeps
    /// being tried while its journal's route moves (a broker died or hands
    /// its journals off): a broken connection, or NO_JOURNAL_PRIMARY_BROKER,
    /// INSUFFICIENT_JOURNAL_BROKERS, REPLICATION_FAILED and the like. Each
    /// try asks the route again; a read goes on from the next offset it
    /// has not printed. A retried append may have committed the first
    /// time; give --offset or registers to keep it exactly once. Content
    /// longer than 16 MiB is streamed and not retried. 0: no retries.
    /// [env: ROTARY_RETRY_FOR] [default: 30s]
    #[arg(long = "retry-for", value_name = "DURATION", value_parser = parse_retry_for)]
    retry_for: Option<std::time::Duration>,
    /// Broker endpoint, any shard's HOST:PORT, or several comma-separated
    /// (the first that answers serves) [env: ROTARY_BROKER] [default: 127.0.0.1:7401]
    #[arg(long = "broker", value_name = "HOST:PORT[,HOST:PORT…]")]
    broker: Option<String>,
}

/// The variable `--retry-for` falls back on.
pub const RETRY_FOR_ENV: &str = "ROTARY_RETRY_FOR";
/// `--retry-for` without the flag or the variable.
const RETRY_FOR_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

impl BrokerArgs {
    /// `--retry-for`, else `ROTARY_RETRY_FOR`, else 30 s.
    fn retry_for(&self) -> Result<std::time::Duration, CliError> {
        if let Some(d) = self.retry_for {
            return Ok(d);
        }
        match std::env::var(RETRY_FOR_ENV) {
            Ok(v) if !v.is_empty() => parse_retry_for(&v).map_err(|why| {
                CliError::Usage("BAD_USAGE", format!("{RETRY_FOR_ENV} {v:?}: {why}"))
            }),
            _ => Ok(RETRY_FOR_DEFAULT),
        }
    }

    /// The endpoint to connect to: `--broker`, else `ROTARY_BROKER`, else
    /// the default. One that is not `HOST:PORT` is bad usage, not an
    /// unreachable broker: trying again cannot help.
    pub(super) fn endpoint(&self) -> Result<String, CliError> {
        let (endpoint, source) = match (&self.broker, std::env::var(BROKER_ENV)) {
            (Some(b), _) => (b.clone(), "--broker"),
            (None, Ok(e)) if !e.is_empty() => (e, BROKER_ENV),
            (None, _) => (BROKER_DEFAULT.to_string(), "the default broker"),
        };
        // Several brokers, comma-separated: the first that answers serves.
        for one in endpoint.split(',') {
            check_endpoint(one.trim()).map_err(|why| {
                CliError::Usage("BAD_USAGE", format!("{source} {endpoint:?}: {why}"))
            })?;
        }
        Ok(endpoint)
    }
}

/// Checks the shape of `HOST:PORT`: a host (a name, an IPv4 address or a
/// bracketed IPv6 address) and a port from 1 to 65535. Whether the host
/// resolves, and whether a broker listens there, is for connecting to find
/// out.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return Err("want HOST:PORT, e.g. 127.0.0.1:7401".into());
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err("want HOST:PORT with a host before the colon".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("port {port:?} is not a number from 1 to 65535")),
    }
}

/// How long a broker has to answer the PING each client command starts with.
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) async fn connect(broker: &BrokerArgs) -> Result<Client, CliError> {
    let options = rotary_net::client::ClientOptions {
        retry_for: broker.retry_for()?,
        ..Default::default()
    };
    answering(Client::connect_with(&broker.endpoint()?, options).await?).await
}

fn parse_retry_for(s: &str) -> Result<std::time::Duration, String> {
    let d = rotary_net::spec::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration such as 30s or 2m"))?;
    if d > std::time::Duration::from_secs(3600) {
        return Err("must be at most 1h".to_string());
    }
    Ok(d)
}

/// The client, once its broker answered a PING. A listener that accepts but
/// never answers (a wedged broker, another service on the port) would
/// otherwise hang the command; this way it fails as UNAVAILABLE (exit 3).
pub(super) async fn answering(client: Client) -> Result<Client, CliError> {
    match tokio::time::timeout(PING_TIMEOUT, client.ping()).await {
        Ok(answer) => answer?,
        Err(_) => {
            return Err(CliError::Client(ClientError::Io {
                endpoint: client.endpoint().to_string(),
                source: std::sync::Arc::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no answer to PING in {} s: is a rotary broker listening there?",
                        PING_TIMEOUT.as_secs()
                    ),
                )),
            }))
        }
    }
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_endpoints() {
        for good in [
            "127.0.0.1:7401",
            "broker-1:1",
            "[::1]:65535",
            "localhost:7401",
        ] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "nonsense",
            "127.0.0.1:99999",
            "127.0.0.1:0",
            ":7401",
            "h:",
            "h:x",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }
}
