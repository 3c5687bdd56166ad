//! An in-memory log: a [`LogSink`] and a [`LogSource`] over one shared
//! byte vector, for tests and simulations. Clones share the bytes, so a
//! recorder appends to the log a player reads, and a test can push other
//! writers' bytes between them. It does not fence.

use std::sync::{Arc, Mutex, PoisonError};

use super::error::{SinkError, SourceError};
use super::player::LogSource;
use super::recorder::LogSink;

#[derive(Clone, Debug, Default)]
pub struct MemLog {
    bytes: Arc<Mutex<Vec<u8>>>,
}

impl MemLog {
    pub fn new() -> MemLog {
        MemLog::default()
    }

    /// The log's length: the offset of the next append.
    pub fn len(&self) -> u64 {
        self.lock().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the log's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.lock().clone()
    }

    /// Appends `bytes` (another writer's, say); returns their offset.
    pub fn push(&self, bytes: &[u8]) -> u64 {
        let mut log = self.lock();
        let offset = log.len() as u64;
        log.extend_from_slice(bytes);
        offset
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A panic while holding the lock leaves whole bytes behind it.
        self.bytes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl From<Vec<u8>> for MemLog {
    fn from(bytes: Vec<u8>) -> MemLog {
        MemLog {
            bytes: Arc::new(Mutex::new(bytes)),
        }
    }
}

impl LogSink for MemLog {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        Ok(self.push(bytes))
    }
}

impl LogSource for MemLog {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<usize, SourceError> {
        let log = self.lock();
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(log.len());
        let n = buf.len().min(log.len() - start);
        buf[..n].copy_from_slice(&log[start..start + n]);
        Ok(n)
    }
}
