//! The one rule that decides whether the tick cuts a stream: [`cut_allowed`]. Every hold
//! is here; nothing else in the filter keeps a stream the clocks say is due.
//!
//! A clock is due ([`Request::due`]) when its deadline passed on the stream's own times:
//! `max_age` from the request headers, `first_token` from the end of the request body
//! until the first progress, `stalled` (idle) from the last progress. Then:
//!
//! 1. **Idle is confirmed by a second tick.** A stall or first-token timeout seen at a
//!    tick is cut at the next tick, and only if nothing arrived in between
//!    ([`Hold::Unconfirmed`]). Between two ticks Envoy's event loop reads every readable
//!    socket (libevent runs the ready I/O before the timers of the same turn), so a stream
//!    whose engine kept sending while the worker did not run (descheduled, throttled,
//!    stopped) shows its progress before the second tick: a stall of the worker costs at
//!    most one tick of latency, never a false cut, and — unlike a hold measured by how
//!    late the ticks come — never switches idleness off for a worker whose ticks are
//!    always late. Max age is the request's own bound and is not confirmed.
//! 2. **A mass stall is held one more window** ([`Hold::MassStall`]): more idle cuts
//!    (stall or first token) than [`stall_threshold`] within one idle window most likely
//!    mean an engine-wide pause or a host anomaly, not that many readers stopped at once.
//!    Those past the threshold wait one more window of their own clock (once per stream;
//!    new progress ends the hold); what is still idle then is cut. The threshold counts
//!    only streams whose idle clock runs ([`Request::idle_clock_on`]), so requests that
//!    cannot stall (queued without a first-token clock, finished, observed) do not raise
//!    it. Observe mode counts nothing (it cuts nothing).
//!
//! 3. **A stall is put to kvguard-control first** (enforce mode): the filter's idle clock
//!    runs where the engine's bytes pass Envoy, and Envoy stops reading the upstream while
//!    its client has not drained the connection's buffer, so a client that reads slower
//!    than the engine writes looks idle here although its engine produces and its client
//!    reads. For a stall this function allows, the tick sends the `stalled` abort allowing
//!    a deferral (contract §3, `recheck_ms`) and keeps the stream open ([`Hold::Asking`]);
//!    kvguard-control, which sees the engine's side, ends the stream or answers
//!    `deferred`. Deferred: the stream is kept and asked about again one idle
//!    window later (new progress ends that wait). Any other answer — ended, not found
//!    (kvguard-control is not on its path, or no longer holds it), refused — or no call
//!    possible cuts it at the next tick, as without kvguard-control. No answer (a
//!    timeout, a transient status, a lost answer) is no verdict: the ask is retried as it
//!    was sent, the stream kept, until an answer or the abort deadline
//!    ([`crate::aborts::DEADLINE_MS`]); a kvguard-control unreachable that long leaves
//!    the filter's own verdict, and the stream is cut. An upstream end that passes while the answer is
//!    awaited, or after one that did not defer, is held and the stream cut at the next
//!    tick ([`crate::request::Request::end_held`]): kvguard-control's end of a stream it
//!    ends must not complete it at Envoy for a client that reads nothing.
//!
//! What is not a hold but keeps a clock from being due: observe mode already flagged the
//! stream (its clocks are off until enforce mode returns and restarts them), the stream is
//! final (complete, ended, aborted), the first-token clock waits for the end of the
//! upload, and a deadline that a `u32` cannot hold. What does not count as progress is
//! the scanner's business ([`crate::scan`]).

use crate::request::Request;
use kvguard_contract::AbortReason;
use std::collections::VecDeque;

/// A mass stall: more idle cuts than this within one idle window are held (at least).
pub const MIN_STALL_THRESHOLD: usize = 8;

/// Idle cuts allowed within one idle window before the rest are held: `max(8, 20 %)` of
/// the streams whose idle clock runs.
pub fn stall_threshold(population: usize) -> usize {
    MIN_STALL_THRESHOLD.max(population / 5)
}

/// Why a stream is not cut now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// No clock is due.
    NotDue,
    /// An idle clock is due for the first time at this tick: cut at the next tick if
    /// nothing arrives in between.
    Unconfirmed,
    /// The mass-stall valve holds it one more window.
    MassStall,
    /// kvguard-control's answer to its stall is awaited.
    Asking,
}

/// The mass-stall valve's state (per VM).
#[derive(Debug, Default)]
pub struct Valve {
    /// Idle cuts decided within the current window (times, ms).
    recent: VecDeque<u64>,
    /// The threshold of this tick.
    threshold: usize,
    /// Whether this tick counts (enforce mode).
    counting: bool,
    /// Streams held at this tick.
    held: i64,
    /// A mass stall is being held (logged once per episode).
    holding: bool,
}

/// What the valve did at one tick (for the metric and the log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Streams held at this tick.
    pub streams: i64,
    /// The threshold.
    pub threshold: usize,
    /// The first tick of an episode (log it).
    pub new_episode: bool,
}

impl Valve {
    /// Starts a tick at `now`: forgets cuts older than `window`, sets the threshold from
    /// the `population` of streams whose idle clock runs.
    pub fn open(&mut self, now: u64, window: u64, population: usize, counting: bool) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_sub(*t) >= window)
        {
            self.recent.pop_front();
        }
        // The population of the window: the streams that may stall now plus those its
        // cuts already closed (gone from the table).
        self.threshold = stall_threshold(population + self.recent.len());
        self.counting = counting;
        self.held = 0;
    }

    /// Ends the tick: what it held, if anything.
    pub fn close(&mut self) -> Option<Held> {
        if self.held > 0 {
            let new_episode = !self.holding;
            self.holding = true;
            return Some(Held {
                streams: self.held,
                threshold: self.threshold,
                new_episode,
            });
        }
        if self.recent.len() < self.threshold {
            self.holding = false;
        }
        None
    }

    /// Admits an idle cut, or holds it (false).
    fn admit(&mut self, req: &mut Request, now: u64) -> bool {
        if !self.counting || req.held() {
            return true;
        }
        if self.recent.len() < self.threshold {
            self.recent.push_back(now);
            return true;
        }
        if req.hold(now) {
            self.held += 1;
            return false;
        }
        true
    }
}

/// May `req` be cut at `now` (a tick, its progress stamped)? `Ok(reason)`: yes, for
/// that reason; `Err(hold)`: no, and why. Arms and holds as it answers (one call per
/// stream per tick). A stall allowed here is put to kvguard-control first (3. above).
pub fn cut_allowed(req: &mut Request, now: u64, valve: &mut Valve) -> Result<AbortReason, Hold> {
    if req.undeferred() {
        return Ok(AbortReason::Stalled);
    }
    if req.asking() {
        return Err(Hold::Asking);
    }
    let reason = req.due(now).ok_or(Hold::NotDue)?;
    if !matches!(
        reason,
        AbortReason::Stalled | AbortReason::FirstTokenTimeout
    ) {
        return Ok(reason);
    }
    if !req.confirm_idle() {
        return Err(Hold::Unconfirmed);
    }
    if !valve.admit(req, now) {
        return Err(Hold::MassStall);
    }
    Ok(reason)
}
