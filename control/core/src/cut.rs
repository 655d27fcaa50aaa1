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
//!   ([`crate::limits::defers`]), or held nowhere (not here, and every peer answered that
//!   it does not hold it) while its sender saw data within the reader timeout: nothing is
//!   held to free, and its gateway may still be draining a completed response's last
//!   bytes to a slow reader, however long after the engine's end (no memory of the
//!   completion is needed, and none is kept: a restart or a bound would forget it). A
//!   deferral changes nothing: it is only an answer.

use crate::limits::{defers, verdict, Limits};
use crate::request::Times;
use kvguard_contract::{AbortReason, AbortRequest};
use std::time::{Duration, Instant};

/// What is known here of the request an end is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Here {
    /// In flight, with these clocks.
    InFlight(Times),
    /// Not in flight here (the peers not asked yet).
    Unknown,
    /// Held nowhere: not here, and every peer answered that it does not hold it. Nothing
    /// is held to free; it may have completed, its reader draining the tail.
    Nowhere,
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

impl Ask {
    /// A gateway's abort, as its body says it.
    pub fn of(abort: &AbortRequest) -> Ask {
        Ask::Abort {
            reason: abort.reason,
            recheck: abort.recheck_ms.is_some(),
            sender_idle: abort.idle_ms.map(Duration::from_millis),
        }
    }
}

/// Why an abort is deferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deferral {
    /// In flight: the engine produces, the reader drains.
    Draining,
    /// Held nowhere: nothing to free, and its reader may drain a completed response's
    /// tail.
    Nowhere,
}

impl Deferral {
    /// For the log.
    pub const fn why(self) -> &'static str {
        match self {
            Deferral::Draining => "the engine produces, the reader drains",
            Deferral::Nowhere => "held nowhere: nothing to free, its reader may drain the tail",
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
            Here::Unknown | Here::Nowhere => Cut::Keep,
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
                (true, Some(reader), Here::Nowhere) => sender_idle
                    .is_some_and(|i| i < reader)
                    .then_some(Deferral::Nowhere),
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
        for here in [Here::Unknown, Here::Nowhere] {
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
    fn an_id_held_nowhere_is_judged_as_a_tail_on_its_senders_silence() {
        let t0 = Instant::now();
        let l = limits();
        assert_eq!(
            may_end(Here::Nowhere, stalled(true, 89), t0, &l),
            Cut::Defer(Deferral::Nowhere)
        );
        assert_eq!(
            may_end(Here::Nowhere, stalled(true, 90), t0, &l),
            Cut::End(AbortReason::Stalled)
        );
        assert_eq!(
            may_end(Here::Nowhere, stalled(false, 1), t0, &l),
            Cut::End(AbortReason::Stalled),
            "a sender that allows no deferral"
        );
        let off = Limits {
            reader_timeout: None,
            ..l
        };
        assert_eq!(
            may_end(Here::Nowhere, stalled(true, 1), t0, &off),
            Cut::End(AbortReason::Stalled),
            "no reader timeout: no reader is waited for"
        );
        let silent = Ask::Abort {
            reason: AbortReason::Stalled,
            recheck: true,
            sender_idle: None,
        };
        assert_eq!(
            may_end(Here::Nowhere, silent, t0, &l),
            Cut::End(AbortReason::Stalled),
            "a sender that says nothing of its silence"
        );
        assert_eq!(
            may_end(Here::Unknown, stalled(true, 1), t0, &l),
            Cut::End(AbortReason::Stalled),
            "nothing known here: the abort goes on (tombstone, peers)"
        );
        assert_eq!(
            [Deferral::Draining, Deferral::Nowhere].map(Deferral::why),
            [
                "the engine produces, the reader drains",
                "held nowhere: nothing to free, its reader may drain the tail"
            ]
        );
    }
}
