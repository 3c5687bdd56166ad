//! rotary's engine: shards, journals, the append and read paths, and the
//! per-core servers.
//!
//! A broker runs one shard per core. Each shard is a compio executor on a
//! thread pinned to its core; it owns the journals hashed to it
//! ([`rotary_net::shard_of`]), their spools, its sockets and its ring. A
//! journal's state is touched by its shard's thread only, so nothing on the
//! data path takes a lock. Admin state (journal specs) is shared behind a
//! lock because it changes rarely and never on the data path.

use std::net::SocketAddr;
use std::path::PathBuf;

/// How `rotary serve` runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Data directory: specs, commit logs, spools and local fragments.
    pub data_dir: PathBuf,
    /// Address of shard 0; shard n listens on the same host, port + n.
    pub listen: SocketAddr,
    /// Number of shards (one per core). 0 = every core of the machine.
    pub cores: usize,
    /// Bytes of free disk the broker never spends on spools.
    pub disk_reserve_bytes: u64,
}

impl ServeConfig {
    pub fn new(data_dir: PathBuf, listen: SocketAddr) -> Self {
        ServeConfig {
            data_dir,
            listen,
            cores: 0,
            disk_reserve_bytes: 256 << 20,
        }
    }
}

/// Runs a broker until SIGINT or SIGTERM, then shuts it down cleanly.
pub fn serve(config: ServeConfig) -> Result<(), EngineError> {
    let _ = config;
    Err(EngineError::NotReady)
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("not ready")]
    NotReady,
}
