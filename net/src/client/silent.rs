//! Endpoints a client stopped hearing from.
//!
//! A broker that is paused or cut off from the network answers nothing:
//! its connection fails only at the silence limit, and a connection opened
//! to it again may be accepted by its kernel and then wait as long. Its
//! journals move once its lease runs out, but until then every route
//! lookup still names it. So a client notes each endpoint whose journal
//! request failed on the network, and until the endpoint answers again:
//!
//! - ROUTE and admin requests go first to the bootstrap endpoints it has
//!   not marked;
//! - a route naming a marked endpoint is asked again, briefly and often,
//!   until it names another broker (the journal moved) or the endpoint
//!   answers a PING (it is back), for at most the time the client already
//!   gave it ([`Silent::wait_limit`]).
//!
//! Owned by one [`super::Client`] and its clones; touched from any task.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// How often a route naming a silent endpoint is asked again.
pub const SILENT_ROUTE_POLL: Duration = Duration::from_millis(100);

/// The endpoints marked silent, each with when it was marked.
#[derive(Debug, Default)]
pub struct Silent {
    marked: Mutex<HashMap<String, Instant>>,
}

/// Endpoints beyond this many marks make the table start over (a client of
/// a huge cluster whose network failed everywhere at once).
const SILENT_ENDPOINTS_MAX: usize = 4096;

impl Silent {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.marked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes that a request to `endpoint` failed on the network now.
    #[allow(clippy::disallowed_methods)] // The mark starts a wait on tokio's timers.
    pub fn mark(&self, endpoint: &str) {
        let mut m = self.lock();
        if !m.contains_key(endpoint) && m.len() >= SILENT_ENDPOINTS_MAX {
            m.clear();
        }
        m.entry(endpoint.to_string()).or_insert_with(Instant::now);
    }

    /// Notes that `endpoint` answered.
    pub fn clear(&self, endpoint: &str) {
        self.lock().remove(endpoint);
    }

    /// When `endpoint` was marked, if it is.
    pub fn since(&self, endpoint: &str) -> Option<Instant> {
        self.lock().get(endpoint).copied()
    }

    pub fn is_marked(&self, endpoint: &str) -> bool {
        self.since(endpoint).is_some()
    }

    /// How long after its mark a route naming a silent endpoint is asked
    /// again before the endpoint is tried anyway: the two silences the
    /// client already waited on it, time enough for a lease of that length
    /// to run out and its journals to move.
    pub fn wait_limit(silence: Duration) -> Duration {
        silence * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_holds_until_cleared_and_keeps_its_first_time() {
        let s = Silent::default();
        assert!(!s.is_marked("a:1"));
        s.mark("a:1");
        let first = s.since("a:1").expect("marked");
        s.mark("a:1");
        assert_eq!(
            s.since("a:1"),
            Some(first),
            "a second mark keeps the first time"
        );
        assert!(!s.is_marked("b:1"));
        s.clear("a:1");
        assert!(!s.is_marked("a:1"));
    }

    #[test]
    fn the_table_starts_over_when_full() {
        let s = Silent::default();
        for i in 0..SILENT_ENDPOINTS_MAX {
            s.mark(&format!("h:{i}"));
        }
        assert!(s.is_marked("h:0"));
        s.mark("one-more:1");
        assert!(s.is_marked("one-more:1"));
        assert!(!s.is_marked("h:0"));
    }
}
