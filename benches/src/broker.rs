//! The broker under load: one started in this process, or one given by
//! `--broker`.

use crate::BenchArgs;
use anyhow::Context as _;
use rotary_engine::{Broker, ServeConfig};
use std::net::SocketAddr;
use std::path::Path;

pub struct Target {
    /// Any shard's endpoint; the client routes from there.
    pub endpoint: String,
    /// The broker this process started, if it did.
    embedded: Option<Broker>,
    shards: Option<usize>,
}

impl Target {
    /// Starts an embedded broker with its data in `data_dir`, unless
    /// `--broker` names one.
    pub fn open(args: &BenchArgs, data_dir: &Path) -> anyhow::Result<Target> {
        if let Some(endpoint) = &args.broker {
            return Ok(Target {
                endpoint: endpoint.clone(),
                embedded: None,
                shards: None,
            });
        }
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
        let mut config = ServeConfig::new(data_dir.to_path_buf(), listen);
        config.cores = args.cores;
        config.cpus = args.broker_cpus.clone().map(|c| c.0).unwrap_or_default();
        if args.wants(crate::Scenario::Backfill) {
            // Uploaded fragments leave the broker's disk at once, so history
            // is read from the store, not from local copies. Only journals
            // with stores have uploaded fragments.
            config.local_cache_bytes = 0;
        }
        let broker = Broker::start(config)
            .with_context(|| format!("starting a broker in {}", data_dir.display()))?;
        let endpoint = broker.endpoints[0].to_string();
        let shards = broker.endpoints.len();
        eprintln!("embedded broker: {shards} shards, shard 0 at {endpoint}");
        Ok(Target {
            endpoint,
            embedded: Some(broker),
            shards: Some(shards),
        })
    }

    pub fn is_embedded(&self) -> bool {
        self.embedded.is_some()
    }

    /// What the figures were measured against.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "endpoint": self.endpoint,
            "embedded": self.is_embedded(),
            "shards": self.shards,
        })
    }

    /// Stops the embedded broker (lets in-flight appends commit).
    pub fn close(self) {
        if let Some(b) = self.embedded {
            b.shutdown();
        }
    }
}
