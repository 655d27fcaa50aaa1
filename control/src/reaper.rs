//! GPU-side reaping, independent of any gateway: the loop that applies the core's
//! verdicts ([`kvguard_control_core::limits`]: max age, idle (stalled) streams,
//! first-token timeouts) to every request in flight.

use crate::state::AppState;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub use kvguard_control_core::limits::{defers, tick, verdict};

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
    let stalled = kvguard_control_core::lease::stall(gap, every);
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
    let due = st.inner().due(now, &limits);
    for (e, reason) in due {
        st.end_request(&e, reason, "reaper");
    }
    st.purge_tombstones();
}
