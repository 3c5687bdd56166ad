//! The one clock of the workspace: every `Instant` and `SystemTime` that
//! library code reads comes from here, so a test can set time and move it.
//!
//! A [`Clock`] is either the real clocks of the process or a manual clock
//! whose time a test sets and advances ([`Clock::manual`],
//! [`Clock::advance`]); it is cheap to clone (a clone of a manual clock
//! shares its time).
//!
//! Call sites read time through the module functions [`now`] and [`wall`],
//! which ask the clock installed on the calling thread ([`install`]; the
//! real clock unless a test installed another). That is a module-level
//! function rather than a `Clock` value threaded through each state machine:
//! the engine reads time in the shard, the journal, the connections, the
//! pipeline and the reaper, and threading one value through all of them is a
//! refactor of its own. A shard runs on one thread, so installing a clock on
//! that thread drives all of its decisions; a decision that is a pure
//! function takes its time as an argument (the engine's `journal::admit`
//! and `TokenBucket::available`) and is driven by passing `clock.now()`.
//!
//! `clippy.toml` disallows `Instant::now`, `SystemTime::now` and their
//! `elapsed` methods (which read the real clock); this module is the one
//! place allowed to call them. Use [`elapsed`] and [`wall_elapsed`].

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, SystemTimeError};

/// The real clocks, or a manual clock shared by its clones.
#[derive(Clone, Default)]
pub struct Clock(Option<Arc<Mutex<Manual>>>);

struct Manual {
    now: Instant,
    wall: SystemTime,
}

impl Clock {
    /// The process's monotonic and wall clocks.
    pub const fn real() -> Clock {
        Clock(None)
    }

    /// A clock that stands still until [`Clock::advance`]d, starting at the
    /// real time of the call.
    #[allow(clippy::disallowed_methods)] // The clock module reads the real clocks.
    pub fn manual() -> Clock {
        Clock(Some(Arc::new(Mutex::new(Manual {
            now: Instant::now(),
            wall: SystemTime::now(),
        }))))
    }

    /// Whether this is a manual clock.
    pub fn is_manual(&self) -> bool {
        self.0.is_some()
    }

    /// The monotonic time.
    #[allow(clippy::disallowed_methods)] // The clock module reads the real clocks.
    pub fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).now,
        }
    }

    /// The wall-clock time.
    #[allow(clippy::disallowed_methods)] // The clock module reads the real clocks.
    pub fn wall(&self) -> SystemTime {
        match &self.0 {
            None => SystemTime::now(),
            Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).wall,
        }
    }

    /// How long ago `since` is on this clock: zero if `since` is later,
    /// as `Instant::elapsed` answers on the real clock.
    pub fn elapsed(&self, since: Instant) -> Duration {
        self.now().saturating_duration_since(since)
    }

    /// Moves a manual clock (and every clone of it) forward by `by`, both
    /// its monotonic and its wall time.
    ///
    /// # Panics
    /// On the real clock, which no one can move.
    pub fn advance(&self, by: Duration) {
        let m = self
            .0
            .as_ref()
            .expect("advance: the real clock cannot be moved");
        let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
        m.now += by;
        m.wall += by;
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_manual() {
            "Clock(manual)"
        } else {
            "Clock(real)"
        })
    }
}

thread_local! {
    static THREAD: RefCell<Clock> = const { RefCell::new(Clock::real()) };
}

/// The monotonic time of the calling thread's clock.
pub fn now() -> Instant {
    THREAD.with(|c| c.borrow().now())
}

/// The wall-clock time of the calling thread's clock.
pub fn wall() -> SystemTime {
    THREAD.with(|c| c.borrow().wall())
}

/// How long ago `since` is on the calling thread's clock: zero if `since`
/// is later. What `Instant::elapsed` answers, but on the installed clock
/// (`clippy.toml` disallows `Instant::elapsed`).
pub fn elapsed(since: Instant) -> Duration {
    now().saturating_duration_since(since)
}

/// How long ago `since` is on the calling thread's wall clock, or the error
/// `SystemTime::elapsed` answers when `since` is later.
pub fn wall_elapsed(since: SystemTime) -> Result<Duration, SystemTimeError> {
    wall().duration_since(since)
}

/// Nanoseconds since the Unix epoch on the calling thread's wall clock (zero
/// before the epoch).
pub fn unix_nanos() -> u128 {
    wall()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Makes `clock` the calling thread's clock until the guard drops, when the
/// clock it replaced comes back.
#[must_use = "the clock is uninstalled when the guard drops"]
pub fn install(clock: Clock) -> Installed {
    let previous = THREAD.with(|c| std::mem::replace(&mut *c.borrow_mut(), clock));
    Installed {
        previous: Some(previous),
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the thread's previous clock when dropped (on the same thread).
pub struct Installed {
    previous: Option<Clock>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(p) = self.previous.take() {
            THREAD.with(|c| *c.borrow_mut() = p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = Clock::manual();
        let (t0, w0) = (clock.now(), clock.wall());
        assert_eq!(clock.now(), t0);
        let other = clock.clone();
        other.advance(Duration::from_millis(1500));
        assert_eq!(clock.now() - t0, Duration::from_millis(1500));
        assert_eq!(
            clock.wall().duration_since(w0).unwrap(),
            Duration::from_millis(1500)
        );
    }

    #[test]
    fn installed_clock_drives_the_module_functions_until_dropped() {
        let clock = Clock::manual();
        let t0 = clock.now();
        {
            let _g = install(clock.clone());
            assert_eq!(now(), t0);
            clock.advance(Duration::from_secs(3));
            assert_eq!(now(), t0 + Duration::from_secs(3));
            assert_eq!(wall(), clock.wall());
        }
        // The real clock is back: it does not stand still at the manual time.
        assert_ne!(now(), t0 + Duration::from_secs(3));
    }

    #[test]
    fn elapsed_reads_the_installed_clock() {
        let clock = Clock::manual();
        let (t0, w0) = (clock.now(), clock.wall());
        let _g = install(clock.clone());
        assert_eq!(elapsed(t0), Duration::ZERO);
        clock.advance(Duration::from_millis(250));
        assert_eq!(elapsed(t0), Duration::from_millis(250));
        assert_eq!(clock.elapsed(t0), Duration::from_millis(250));
        assert_eq!(wall_elapsed(w0).unwrap(), Duration::from_millis(250));
        // A time in the clock's future is zero ago, not a panic.
        assert_eq!(elapsed(t0 + Duration::from_secs(1)), Duration::ZERO);
        assert!(wall_elapsed(w0 + Duration::from_secs(1)).is_err());
    }

    #[test]
    #[should_panic(expected = "real clock cannot be moved")]
    fn the_real_clock_cannot_be_advanced() {
        Clock::real().advance(Duration::from_secs(1));
    }
}
