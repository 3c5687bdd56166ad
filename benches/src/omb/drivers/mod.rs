//! The systems `rotary bench --workload` can drive: rotary itself and the
//! peers it is compared with.

pub mod kafka;
pub mod nats;
pub mod redis;
pub mod rotary;

use super::driver::Driver;

/// The names `--driver` accepts.
pub const DRIVERS: &[&str] = &["rotary", "nats", "redis", "kafka"];

/// Connects the driver `name` to the system at `endpoint` (`HOST:PORT`) for
/// a workload whose messages are `message_size` bytes long.
pub async fn connect(
    name: &str,
    endpoint: &str,
    message_size: usize,
) -> anyhow::Result<Box<dyn Driver>> {
    match name {
        "rotary" => Ok(Box::new(
            rotary::RotaryDriver::connect(endpoint, message_size, Default::default()).await?,
        )),
        "nats" => nats::connect(endpoint).await,
        "redis" => redis::connect(endpoint).await,
        "kafka" => kafka::connect(endpoint, message_size).await,
        _ => anyhow::bail!(
            "unknown driver {name:?}; known drivers: {}",
            DRIVERS.join(", ")
        ),
    }
}
