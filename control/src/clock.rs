//! Time, behind a trait so that the reaper, tombstones and replay memory can be tested
//! with an injected clock.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of monotonic and wall-clock time.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic now (request ages, timeouts).
    fn now(&self) -> Instant;
    /// Unix seconds (signatures, stamps, checkpoint timestamps).
    fn unix_secs(&self) -> u64;
}

/// The real clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn unix_secs(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }
}

/// A clock that moves only when told (tests).
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    base_unix: u64,
    offset: Mutex<Duration>,
}

impl ManualClock {
    /// Starts at the real now and the given unix time.
    pub fn new(base_unix: u64) -> Self {
        ManualClock {
            base: Instant::now(),
            base_unix,
            offset: Mutex::new(Duration::ZERO),
        }
    }

    /// Moves time forward.
    pub fn advance(&self, d: Duration) {
        if let Ok(mut o) = self.offset.lock() {
            *o += d;
        }
    }

    fn offset(&self) -> Duration {
        self.offset.lock().map(|o| *o).unwrap_or_default()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.offset()
    }
    fn unix_secs(&self) -> u64 {
        self.base_unix + self.offset().as_secs()
    }
}
