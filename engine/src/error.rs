//! The engine's error: what failed, with the parts a caller acts on (the
//! file, the address, the figures), and whether trying again can help
//! ([`EngineError::is_retryable`]). How errors reach clients as wire
//! statuses is decided where they are answered (`STORAGE_FULL` for a full
//! disk, `IO_ERROR` for other local I/O failures; docs/PROTOCOL.md), not
//! here.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::cluster::control::ControlError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file system call on the path failed.
    #[error("{0}: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error(transparent)]
    Storage(#[from] rotary_storage::StorageError),
    /// The broker was asked to run in a way it cannot.
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// A file of the data directory contradicts itself or the others:
    /// `path` is the file found wrong, `why` the whole account (naming the
    /// files involved).
    #[error("corrupt data: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, #[source] std::io::Error),
    /// A thread of the broker could not be started.
    #[error("cannot start the {0} thread: {1}")]
    Thread(&'static str, #[source] std::io::Error),
    /// A shard's thread ended before it reported that it listens.
    #[error("a shard thread died while starting")]
    ShardDied,
    /// The broker's session with its cluster on etcd failed.
    #[error(transparent)]
    Etcd(#[from] ControlError),
}

/// What is wrong with the broker's configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("data directory {}: not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error("data directory {} is in use by another rotary process", .0.display())]
    DataDirInUse(PathBuf),
    /// The data directory keeps the shard count it was created with.
    #[error("data directory {} was created with {had} shards; start with --cores {had} (asked for {asked})", .dir.display())]
    ShardCount {
        dir: PathBuf,
        had: usize,
        asked: usize,
    },
    #[error("--cores {asked}: at most {max} shards")]
    TooManyShards { asked: usize, max: usize },
    /// `--cpus` names a core the machine lacks (it has `0..online`).
    #[error("--cpus: core {core} does not exist here (cores 0 to {})", .online - 1)]
    NoSuchCore { core: usize, online: usize },
    /// The broker's threads could not be kept to its cores.
    #[error("--cpus {cores:?}: {source}")]
    Confine {
        cores: Vec<usize>,
        #[source]
        source: std::io::Error,
    },
    /// Shard n listens on the first port + n, past the last port.
    #[error("port range overflows")]
    PortRange { port: u16, shards: usize },
    /// The static cluster file is unreadable or does not name this broker.
    #[error("{why}")]
    ClusterFile { path: PathBuf, why: String },
}

impl EngineError {
    /// Corruption found in `path`; `why` tells the whole story.
    pub fn corrupt(path: impl Into<PathBuf>, why: impl Into<String>) -> EngineError {
        EngineError::Corrupt {
            path: path.into(),
            why: why.into(),
        }
    }

    /// Whether the failed operation may succeed if tried again, unchanged,
    /// later. A full disk may get space back and a busy port be freed; a
    /// disk that failed an I/O (`EIO`: it is dying, and a shard retrying
    /// would retry for ever), corrupt data and a configuration the broker
    /// cannot run stay as they are until someone acts.
    pub fn is_retryable(&self) -> bool {
        match self {
            EngineError::Io(_, e) => rotary_storage::io_is_retryable(e),
            EngineError::Storage(e) => e.is_retryable(),
            EngineError::Config(_) | EngineError::Corrupt { .. } | EngineError::ShardDied => false,
            EngineError::Listen(_, e) => {
                e.kind() == std::io::ErrorKind::AddrInUse || rotary_storage::io_is_retryable(e)
            }
            EngineError::Thread(_, e) => rotary_storage::io_is_retryable(e),
            EngineError::Etcd(e) => e.is_retryable(),
        }
    }

    /// Whether the error is a full disk (or quota), which clients are told
    /// as the retryable `STORAGE_FULL`.
    pub fn is_full(&self) -> bool {
        match self {
            EngineError::Io(_, e) => matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)),
            EngineError::Storage(e) => e.is_full(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(errno: i32) -> std::io::Error {
        std::io::Error::from_raw_os_error(errno)
    }

    /// An EIO from the disk is final, wherever it surfaces; a full disk is
    /// not.
    #[test]
    fn eio_is_not_retryable_a_full_disk_is() {
        let eio = EngineError::Io("/d/specs.json".into(), io(libc::EIO));
        assert!(!eio.is_retryable() && !eio.is_full());
        let stored = EngineError::from(rotary_storage::StorageError::io(
            std::path::Path::new("/d/commit.log"),
            io(libc::EIO),
        ));
        assert!(!stored.is_retryable() && !stored.is_full());
        let read_only = EngineError::Io("/d/specs.json".into(), io(libc::EROFS));
        assert!(!read_only.is_retryable());
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let full = EngineError::Io("/d/specs.json".into(), io(errno));
            assert!(full.is_retryable() && full.is_full(), "{full}");
            let stored = EngineError::from(rotary_storage::StorageError::io(
                std::path::Path::new("/d/spool"),
                io(errno),
            ));
            assert!(stored.is_retryable() && stored.is_full(), "{stored}");
        }
        let interrupted = EngineError::Io("/d".into(), io(libc::EINTR));
        assert!(interrupted.is_retryable() && !interrupted.is_full());
    }

    /// What only an operator can fix is not retryable.
    #[test]
    fn corruption_and_configuration_are_not_retryable() {
        let corrupt = EngineError::corrupt("/d/commit.log", "/d/commit.log is missing");
        assert!(!corrupt.is_retryable());
        assert_eq!(
            corrupt.to_string(),
            "corrupt data: /d/commit.log is missing"
        );
        let count = EngineError::from(ConfigError::ShardCount {
            dir: "/d".into(),
            had: 2,
            asked: 4,
        });
        assert!(!count.is_retryable());
        assert_eq!(
            count.to_string(),
            "configuration: data directory /d was created with 2 shards; start with --cores 2 (asked for 4)"
        );
        assert!(!EngineError::ShardDied.is_retryable());
    }

    /// A port held by another process may be freed; etcd's answers say for
    /// themselves.
    #[test]
    fn a_busy_port_and_an_unreachable_etcd_are_retryable() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let busy = EngineError::Listen(addr, std::io::ErrorKind::AddrInUse.into());
        assert!(busy.is_retryable());
        let timeout = rotary_etcd::Error::Timeout {
            op: "txn",
            timeout: std::time::Duration::from_secs(5),
        };
        assert!(EngineError::from(ControlError::Etcd(timeout)).is_retryable());
        assert!(!EngineError::from(ControlError::TxnFailed("revision".into())).is_retryable());
        // A request etcd refuses as such stays refused.
        let refused = rotary_etcd::Error::InvalidArgument { what: "too large" };
        assert!(!EngineError::from(ControlError::Etcd(refused)).is_retryable());
    }
}
