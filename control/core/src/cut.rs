//! May kvguard-control end a request now? The one answer, for every way an end is asked
//! for: the reaper's pass over the clocks, and a gateway's abort. (Shutdown, an operator's
//! abort and an expired lease end what they name; P/D legs and peers only route an abort
//! to where this is asked.)
//!
//! - **The reaper** ends a request whose clocks are due ([`crate::limits::verdict`]: max
//!   age, first-token timeout, stalled).
//! - **An abort** is carried out, unless it is a `stalled` abort whose sender allows a
//!   deferral (`recheck_ms`, contract §3) for a stream that is only slow to drain
//!   downstream: in flight here and producing while its reader drains
//!   ([`crate::limits::defers`]), or completed here within the reader timeout while its
//!   sender saw no data for less than it (its gateway still holds the last bytes for a
//!   slow reader, and nothing is left to free at the engine). A deferral changes nothing:
//!   it is only an answer.

use crate::limits::{defers, verdict, Limits};
use crate::request::Times;
use kvguard_contract::AbortReason;
use std::time::{Duration, Instant};

/// What is known here of the request an end is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Here {
    /// In flight, with these clocks.
    InFlight(Times),
    /// Completed here ([`crate::inflight::Inflight::completed`]).
    Completed,
    /// Neither.
    Unknown,
}

/// Who asks for the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// The reaper's pass.
    Reaper,
    /// A gateway's abort (contract §3).
    Abort {
        /// Its reason.
        reason: AbortReason,
        /// Whether its sender allows a deferral (`recheck_ms`).
        recheck: bool,
        /// How long its sender saw no data (`idle_ms`).
        sender_idle: Option<Duration>,
    },
}

/// Why an abort is deferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deferral {
    /// In flight: the engine produces, the reader drains.
    Draining,
    /// Completed here: the reader drains its tail.
    Tail,
}

impl Deferral {
    /// For the log.
    pub const fn why(self) -> &'static str {
        match self {
            Deferral::Draining => "the engine produces, the reader drains",
            Deferral::Tail => "the engine finished, the reader drains its tail",
        }
    }
}

/// The answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// End it (an abort: carry it out, wherever the request is) for this reason.
    End(AbortReason),
    /// An abort answered `deferred`: nothing changes.
    Defer(Deferral),
    /// Nothing is due.
    Keep,
}

/// May the request be ended now, on this ask? `here`: what this replica knows of it;
/// `limits`: the reaper's.
pub fn may_end(here: Here, ask: Ask, now: Instant, limits: &Limits) -> Cut {
    match ask {
        Ask::Reaper => match here {
            Here::InFlight(t) => verdict(&t, now, limits).map_or(Cut::Keep, Cut::End),
            Here::Completed | Here::Unknown => Cut::Keep,
        },
        Ask::Abort {
            reason,
            recheck,
            sender_idle,
        } => {
            let deferrable = reason == AbortReason::Stalled && recheck;
            let deferral = match (deferrable, limits.reader_timeout, here) {
                (true, Some(_), Here::InFlight(t)) => {
                    defers(&t, now, limits, sender_idle).then_some(Deferral::Draining)
                }
                (true, Some(reader), Here::Completed) => sender_idle
                    .is_some_and(|i| i < reader)
                    .then_some(Deferral::Tail),
                _ => None,
            };
            deferral.map_or(Cut::End(reason), Cut::Defer)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Flow;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// Idle 60 s, reader 90 s (the shipped defaults).
    fn limits() -> Limits {
        Limits {
            max_age: Some(s(1800)),
            idle_timeout: Some(s(60)),
            first_token_timeout: None,
            reader_timeout: Some(s(90)),
        }
    }

    /// A stream whose last data event came at `t0`, waiting on its reader since then.
    fn draining(t0: Instant) -> Times {
        Times {
            started: t0,
            first_data: Some(t0),
            last_data: Some(t0),
            stalled: Duration::ZERO,
            flow: Some(Flow::Reader(t0)),
            drained: Duration::ZERO,
            gateway: false,
        }
    }

    fn stalled(recheck: bool, idle: u64) -> Ask {
        Ask::Abort {
            reason: AbortReason::Stalled,
            recheck,
            sender_idle: Some(s(idle)),
        }
    }

    #[test]
    fn the_reaper_ends_what_its_verdict_says_and_nothing_it_does_not_hold() {
        let t0 = Instant::now();
        let l = limits();
        let t = draining(t0);
        assert_eq!(
            may_end(Here::InFlight(t), Ask::Reaper, t0 + s(89), &l),
            Cut::Keep
        );
        assert_eq!(
            may_end(Here::InFlight(t), Ask::Reaper, t0 + s(90), &l),
            Cut::End(AbortReason::Stalled)
        );
        for here in [Here::Completed, Here::Unknown] {
            assert_eq!(may_end(here, Ask::Reaper, t0 + s(9999), &l), Cut::Keep);
        }
    }

    #[test]
    fn a_stalled_abort_that_allows_it_is_deferred_while_the_reader_drains() {
        let t0 = Instant::now();
        let l = limits();
        let here = Here::InFlight(draining(t0));
        assert_eq!(
            may_end(here, stalled(true, 61), t0 + s(61), &l),
            Cut::Defer(Deferral::Draining)
        );
        // Without recheck, another reason, or no reader timeout: carried out.
        assert_eq!(
            may_end(here, stalled(false, 61), t0 + s(61), &l),
            Cut::End(AbortReason::Stalled)
        );
        let gone = Ask::Abort {
            reason: AbortReason::DownstreamReset,
            recheck: true,
            sender_idle: Some(s(1)),
        };
        assert_eq!(
            may_end(here, gone, t0 + s(1), &l),
            Cut::End(AbortReason::DownstreamReset)
        );
        let off = Limits {
            reader_timeout: None,
            ..l
        };
        assert_eq!(
            may_end(here, stalled(true, 61), t0 + s(61), &off),
            Cut::End(AbortReason::Stalled)
        );
        // The reader took nothing for the reader timeout: carried out.
        assert_eq!(
            may_end(here, stalled(true, 61), t0 + s(90), &l),
            Cut::End(AbortReason::Stalled)
        );
    }

    #[test]
    fn a_completed_stream_s_tail_is_deferred_while_its_sender_saw_data_within_the_reader_timeout() {
        let t0 = Instant::now();
        let l = limits();
        assert_eq!(
            may_end(Here::Completed, stalled(true, 89), t0, &l),
            Cut::Defer(Deferral::Tail)
        );
        assert_eq!(
            may_end(Here::Completed, stalled(true, 90), t0, &l),
            Cut::End(AbortReason::Stalled)
        );
        let silent = Ask::Abort {
            reason: AbortReason::Stalled,
            recheck: true,
            sender_idle: None,
        };
        assert_eq!(
            may_end(Here::Completed, silent, t0, &l),
            Cut::End(AbortReason::Stalled)
        );
        assert_eq!(
            may_end(Here::Unknown, stalled(true, 1), t0, &l),
            Cut::End(AbortReason::Stalled),
            "nothing known here: the abort goes on (tombstone, peers)"
        );
        assert_eq!(
            [Deferral::Draining, Deferral::Tail].map(Deferral::why),
            [
                "the engine produces, the reader drains",
                "the engine finished, the reader drains its tail"
            ]
        );
    }
}
