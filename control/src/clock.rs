//! Time, behind a trait so that the reaper, tombstones and replay memory can be tested
//! with an injected clock (`testing::ManualClock`, feature `test-support`).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

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
