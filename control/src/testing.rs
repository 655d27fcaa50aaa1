//! Test doubles (feature `test-support`, never in the production build): a clock that
//! moves only when told, an engine that never answers, GPU probes with canned or hanging
//! answers.

use crate::clock::Clock;
use crate::engine::{BoxFut, Engine};
use crate::gpu::{GpuProbe, GpuSnapshot};
use kvguard_contract::RequestId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// An engine whose metrics and health never answer and whose abort API always succeeds.
#[derive(Debug)]
pub struct FakeEngine;

impl Engine for FakeEngine {
    fn scrape(&self) -> BoxFut<'_, Result<String, String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn health(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Err("fake".into()) })
    }
    fn abort(&self, _id: RequestId) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// A clock that moves only when told.
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

/// A probe returning canned answers.
#[derive(Debug, Default)]
pub struct FakeProbe {
    answers: Mutex<Vec<Result<GpuSnapshot, String>>>,
}

impl FakeProbe {
    /// Answers these, in order; the last one repeats.
    pub fn new(answers: Vec<Result<GpuSnapshot, String>>) -> Self {
        FakeProbe {
            answers: Mutex::new(answers),
        }
    }
}

impl GpuProbe for FakeProbe {
    fn sample(&self) -> Result<GpuSnapshot, String> {
        let mut a = self
            .answers
            .lock()
            .map_err(|_| "fake probe poisoned".to_owned())?;
        match a.len() {
            0 => Err("no answer".to_owned()),
            1 => a[0].clone(),
            _ => a.remove(0),
        }
    }
}

/// A probe whose calls block until released, as a hung driver does; counts the calls.
#[derive(Debug, Default)]
pub struct HangingProbe {
    released: Mutex<bool>,
    cv: Condvar,
    calls: AtomicU64,
}

impl HangingProbe {
    /// Calls made so far (including the one hanging).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Acquire)
    }

    /// Lets every call, present and future, return an empty snapshot.
    pub fn release(&self) {
        if let Ok(mut r) = self.released.lock() {
            *r = true;
        }
        self.cv.notify_all();
    }
}

impl GpuProbe for HangingProbe {
    fn sample(&self) -> Result<GpuSnapshot, String> {
        self.calls.fetch_add(1, Ordering::AcqRel);
        let mut r = self
            .released
            .lock()
            .map_err(|_| "probe poisoned".to_owned())?;
        while !*r {
            r = self.cv.wait(r).map_err(|_| "probe poisoned".to_owned())?;
        }
        Ok(GpuSnapshot::default())
    }
}
