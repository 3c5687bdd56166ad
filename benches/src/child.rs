//! Child processes (echo server, fio, iperf3): each is stopped by its own
//! PID, and waited for with a deadline.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// How often a deadline wait looks at the child.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Kills the child by its PID when dropped (if it still runs), then reaps it.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Waits for the child to exit, at most `timeout`; kills it by PID if
    /// it has not exited by then.
    pub fn wait_timeout(&mut self, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.0.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                self.0.kill()?;
                self.0.wait()?;
                return Ok(None);
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}
