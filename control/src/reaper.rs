//! GPU-side reaping, independent of any gateway: max age, idle (stalled) streams and
//! first-token timeouts, judged on an injected clock; the loop that applies them.

use crate::config::Limits;
use crate::state::AppState;
use crate::table::Times;
use kvguard_contract::AbortReason;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Runs the reaper every [`tick`] until `stop`. A pass that comes late (the process
/// stalled) first credits the stall to every request in flight ([`note_reaper_gap`]).
pub fn spawn(st: Arc<AppState>, stop: CancellationToken) {
    let every = tick(&st.cfg.limits);
    run_every(st, every, stop, move |st, gap| {
        note_reaper_gap(st, gap, every);
        reap_once(st);
    });
}

/// Runs `pass` every `period` until `stop`, with the gap since the previous pass on
/// kvguard-control's clock (a gap well over the period is a stall of the process).
pub fn run_every(
    st: Arc<AppState>,
    period: Duration,
    stop: CancellationToken,
    mut pass: impl FnMut(&Arc<AppState>, Duration) + Send + 'static,
) {
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(period);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = st.clock.now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = iv.tick() => {}
            }
            let now = st.clock.now();
            pass(&st, now.saturating_duration_since(last));
            last = now;
        }
    });
}

/// Takes the gap since the reaper's last pass: a stall (see [`crate::lease::stall`]) is
/// counted, logged and credited to every request in flight ([`crate::table::Entry::credit_stall`]),
/// so that no stream is ended `stalled` for data that reached kvguard-control while it
/// could not run and is not recorded yet. A stream that stays silent is still ended, the
/// stall later. Returns the stall.
pub fn note_reaper_gap(st: &AppState, gap: Duration, every: Duration) -> Duration {
    let stalled = crate::lease::stall(gap, every);
    if !stalled.is_zero() {
        st.metrics.reaper_stalls.inc();
        let now = st.clock.now();
        let entries = st.entries();
        for e in &entries {
            e.credit_stall(stalled, now);
        }
        tracing::warn!(
            stall_ms = stalled.as_millis() as u64,
            requests = entries.len(),
            "the reaper stalled; the stall is credited to every request in flight"
        );
    }
    stalled
}

/// One pass over the in-flight table (ended requests have left it already), then the
/// expired tombstones.
pub fn reap_once(st: &Arc<AppState>) {
    let now = st.clock.now();
    let limits = st.cfg.limits;
    for e in st.entries() {
        if let Some(reason) = verdict(&e.times(), now, &limits) {
            st.end_request(&e, reason, "reaper");
        }
    }
    st.purge_tombstones();
}

/// Whether a request is due to be ended at `now`, and why. Checked in order: max age
/// (from the start), first-token timeout (from the start, until the first data event),
/// idle (from the last data event, only after the first one).
pub fn verdict(t: &Times, now: Instant, limits: &Limits) -> Option<AbortReason> {
    let age = now.saturating_duration_since(t.started);
    if limits.max_age.is_some_and(|m| age >= m) {
        return Some(AbortReason::MaxAge);
    }
    match t.last_data {
        None => {
            let waited = age.saturating_sub(t.stalled);
            if limits.first_token_timeout.is_some_and(|f| waited >= f) {
                return Some(AbortReason::FirstTokenTimeout);
            }
        }
        Some(last) => {
            if limits
                .idle_timeout
                .is_some_and(|i| now.saturating_duration_since(last) >= i)
            {
                return Some(AbortReason::Stalled);
            }
        }
    }
    None
}

/// How often the reaper looks: a quarter of the smallest limit, between 10 ms and 1 s.
pub fn tick(limits: &Limits) -> Duration {
    [
        limits.max_age,
        limits.idle_timeout,
        limits.first_token_timeout,
    ]
    .into_iter()
    .flatten()
    .min()
    .map_or(Duration::from_secs(1), |d| d / 4)
    .clamp(Duration::from_millis(10), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::testing::ManualClock;

    /// A request started now with no data event yet, `stalled` credited.
    fn waiting(c: &ManualClock, stalled: Duration) -> Times {
        Times {
            started: c.now(),
            first_data: None,
            last_data: None,
            stalled,
        }
    }

    fn limits(max_age: u64, idle: u64, first: Option<u64>) -> Limits {
        Limits {
            max_age: Some(Duration::from_secs(max_age)),
            idle_timeout: Some(Duration::from_secs(idle)),
            first_token_timeout: first.map(Duration::from_secs),
        }
    }

    #[test]
    fn idle_runs_from_last_data_event_only_after_the_first() {
        let c = ManualClock::new(0);
        let l = limits(900, 120, None);
        let mut t = waiting(&c, Duration::ZERO);
        // Queued / prefill for a long time: not stalled (first-token timeout is off).
        c.advance(Duration::from_secs(300));
        assert_eq!(verdict(&t, c.now(), &l), None);
        t.first_data = Some(c.now());
        t.last_data = Some(c.now());
        c.advance(Duration::from_secs(119));
        assert_eq!(verdict(&t, c.now(), &l), None);
        c.advance(Duration::from_secs(1));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::Stalled));
        // Progress resets the idle clock.
        t.last_data = Some(c.now());
        assert_eq!(verdict(&t, c.now(), &l), None);
    }

    #[test]
    fn first_token_timeout() {
        let c = ManualClock::new(0);
        let l = limits(900, 120, Some(30));
        let mut t = waiting(&c, Duration::ZERO);
        c.advance(Duration::from_secs(29));
        assert_eq!(verdict(&t, c.now(), &l), None);
        c.advance(Duration::from_secs(1));
        assert_eq!(
            verdict(&t, c.now(), &l),
            Some(AbortReason::FirstTokenTimeout)
        );
        t.first_data = Some(c.now());
        t.last_data = Some(c.now());
        assert_eq!(verdict(&t, c.now(), &l), None);
    }

    #[test]
    fn a_stall_of_kvguard_control_does_not_count_against_the_first_token() {
        let c = ManualClock::new(0);
        let l = limits(900, 120, Some(30));
        let mut t = waiting(&c, Duration::from_secs(10));
        c.advance(Duration::from_secs(39));
        assert_eq!(verdict(&t, c.now(), &l), None, "29 s of waiting of its own");
        c.advance(Duration::from_secs(1));
        assert_eq!(
            verdict(&t, c.now(), &l),
            Some(AbortReason::FirstTokenTimeout)
        );
        // Max age is not moved by a stall.
        t.stalled = Duration::from_secs(1000);
        c.advance(Duration::from_secs(860));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::MaxAge));
    }

    #[test]
    fn max_age_whatever_the_progress_and_first() {
        let c = ManualClock::new(0);
        let l = limits(60, 10, Some(5));
        let mut t = Times {
            started: c.now(),
            first_data: Some(c.now()),
            last_data: Some(c.now()),
            stalled: Duration::ZERO,
        };
        for _ in 0..59 {
            c.advance(Duration::from_secs(1));
            t.last_data = Some(c.now());
            assert_eq!(verdict(&t, c.now(), &l), None);
        }
        c.advance(Duration::from_secs(1));
        t.last_data = Some(c.now());
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::MaxAge));
        // Max age wins over stalled when both are due.
        c.advance(Duration::from_secs(100));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::MaxAge));
    }

    #[test]
    fn everything_off() {
        let c = ManualClock::new(0);
        let t = waiting(&c, Duration::ZERO);
        c.advance(Duration::from_secs(1_000_000));
        assert_eq!(verdict(&t, c.now(), &Limits::default()), None);
        assert_eq!(tick(&Limits::default()), Duration::from_secs(1));
        assert_eq!(tick(&limits(900, 120, None)), Duration::from_secs(1));
        let short = Limits {
            idle_timeout: Some(Duration::from_millis(200)),
            ..Limits::default()
        };
        assert_eq!(tick(&short), Duration::from_millis(50));
    }
}
