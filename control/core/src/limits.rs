//! The reaper's limits and its verdicts on one request's clocks: max age, first-token
//! timeout, stalled (the engine's silence, or a reader that takes nothing), and when a
//! gateway's `stalled` abort is deferred instead. Pure: the time is an input.

use crate::request::Times;
use kvguard_contract::AbortReason;
use std::time::{Duration, Instant};

/// The reaper's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// From the request's start.
    pub max_age: Option<Duration>,
    /// From the last data event, once there was one.
    pub idle_timeout: Option<Duration>,
    /// From the request's start until the first data event.
    pub first_token_timeout: Option<Duration>,
    /// From the last response frame the gateway's side took, while it takes no other
    /// ([`crate::request::Flow::Reader`]); `None`: no reader clock, the idle one counts
    /// from the last data event.
    pub reader_timeout: Option<Duration>,
}

/// Whether a request is due to be ended at `now`, and why. Checked in order: max age
/// (from the start), first-token timeout (from the start, until the first data event),
/// then, after the first data event, `stalled` for either side ([`crate::request::Flow`]): the reader's
/// wait against the reader timeout (from the last frame the gateway's side took; not for
/// a request a kvguard gateway carries, [`Times::gateway`]: its stall aborts judge the
/// reader), the
/// engine's silence against the idle timeout ([`Times::engine_silence`]: since the last
/// data event, less the time the response waited on its reader). A client that reads
/// slower than the engine writes is therefore judged by the drain's progress, never by
/// the idle timeout. With no reader timeout, idle counts from the last data event,
/// whoever is slow.
pub fn verdict(t: &Times, now: Instant, limits: &Limits) -> Option<AbortReason> {
    let age = now.saturating_duration_since(t.started);
    if limits.max_age.is_some_and(|m| age >= m) {
        return Some(AbortReason::MaxAge);
    }
    let Some(last) = t.last_data else {
        let waited = age.saturating_sub(t.stalled);
        return limits
            .first_token_timeout
            .is_some_and(|f| waited >= f)
            .then_some(AbortReason::FirstTokenTimeout);
    };
    let silence = match limits.reader_timeout {
        Some(reader) => {
            if !t.gateway && t.reader_wait(now).is_some_and(|w| w >= reader) {
                return Some(AbortReason::Stalled);
            }
            t.engine_silence(now).unwrap_or_default()
        }
        None => now.saturating_duration_since(last),
    };
    limits
        .idle_timeout
        .is_some_and(|i| silence >= i)
        .then_some(AbortReason::Stalled)
}

/// Whether a gateway's `stalled` abort that allows a deferral (contract §3, `recheck_ms`)
/// is deferred at `now` rather than carried out: the stream is not stalled at the engine,
/// only slow to drain downstream. `sender_idle`: how long the sender saw no data
/// (`idle_ms`). The gateway sees data only when its client has drained its buffer, so its
/// silence is the drain's evidence, and kvguard-control's own is the engine's:
///
/// - The sender saw nothing for the reader timeout or longer: not deferred (its reader
///   took nothing through the gateway for that long).
/// - It has waited on its reader here for the reader timeout, and no kvguard gateway
///   carries it ([`Times::gateway`]): not deferred.
/// - Otherwise deferred while the engine has been silent ([`Times::engine_silence`]) for
///   less than half of what the sender saw. An engine that stopped is silent here at
///   least as long as at the sender (the sender sees its last bytes later; keep-alives
///   are no data); a silence the sender saw while the engine kept producing was the
///   drain's (the bytes wait in the buffers between, which on Linux absorb megabytes),
///   and the engine is silent here for at most the gap between two of its data events.
///
/// Never deferred: no reader timeout (`off`), no data event yet (a first-token wait is
/// not the drain's), before the gateway first asked for the body, a sender that did not
/// say how long it saw no data.
pub fn defers(t: &Times, now: Instant, limits: &Limits, sender_idle: Option<Duration>) -> bool {
    let (Some(reader), Some(silence), Some(_), Some(idle)) = (
        limits.reader_timeout,
        t.engine_silence(now),
        t.flow,
        sender_idle,
    ) else {
        return false;
    };
    idle < reader
        && (t.gateway || t.reader_wait(now).is_none_or(|w| w < reader))
        && silence < idle / 2
}

/// How often the reaper looks: a quarter of the smallest limit, between 10 ms and 1 s.
pub fn tick(limits: &Limits) -> Duration {
    [
        limits.max_age,
        limits.idle_timeout,
        limits.first_token_timeout,
        limits.reader_timeout,
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
    use crate::request::Flow;
    use std::cell::Cell;

    /// Time for the verdicts: starts at an arbitrary instant, moved by hand.
    struct ManualClock(Cell<Instant>);

    impl ManualClock {
        fn new(_unix: u64) -> ManualClock {
            ManualClock(Cell::new(Instant::now()))
        }

        fn now(&self) -> Instant {
            self.0.get()
        }

        fn advance(&self, d: Duration) {
            self.0.set(self.0.get() + d);
        }
    }

    /// A request started now with no data event yet, `stalled` credited.
    fn waiting(c: &ManualClock, stalled: Duration) -> Times {
        Times {
            started: c.now(),
            first_data: None,
            last_data: None,
            stalled,
            flow: None,
            drained: Duration::ZERO,
            gateway: false,
        }
    }

    /// A request started now whose first data event came now.
    fn flowing(c: &ManualClock) -> Times {
        Times {
            first_data: Some(c.now()),
            last_data: Some(c.now()),
            ..waiting(c, Duration::ZERO)
        }
    }

    fn limits(max_age: u64, idle: u64, first: Option<u64>) -> Limits {
        Limits {
            max_age: Some(Duration::from_secs(max_age)),
            idle_timeout: Some(Duration::from_secs(idle)),
            first_token_timeout: first.map(Duration::from_secs),
            reader_timeout: None,
        }
    }

    /// Idle 10 s, reader 90 s; a stream whose first data event came now.
    fn streaming(c: &ManualClock) -> (Times, Limits) {
        let mut l = limits(10_000, 10, None);
        l.reader_timeout = Some(Duration::from_secs(90));
        (flowing(c), l)
    }

    #[test]
    fn a_reader_that_does_not_drain_is_judged_by_the_reader_timeout_not_the_idle_one() {
        let c = ManualClock::new(0);
        let s = Duration::from_secs;
        let (mut t, l) = streaming(&c);
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(89));
        assert_eq!(verdict(&t, c.now(), &l), None, "89 s waiting on its reader");
        c.advance(s(1));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::Stalled));
        // The drain progressed 1 s ago (that wait, 90 s, is no silence of the engine's);
        // the engine is asked since and silent: its idle timeout counts from then.
        t.drained = s(90);
        t.flow = Some(Flow::Engine(c.now()));
        c.advance(s(9));
        assert_eq!(verdict(&t, c.now(), &l), None);
        c.advance(s(1));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::Stalled));
        // No reader timeout: idle counts from the last data event, whoever is slow.
        let off = Limits {
            reader_timeout: None,
            ..l
        };
        let (mut t, _) = streaming(&c);
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(10));
        assert_eq!(verdict(&t, c.now(), &off), Some(AbortReason::Stalled));
        assert_eq!(verdict(&t, c.now(), &l), None);
        // Before the gateway first asked: idle from the last data event.
        let (t, l) = streaming(&c);
        c.advance(s(10));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::Stalled));
    }

    #[test]
    fn behind_a_kvguard_gateway_the_reader_is_judged_by_the_gateway_not_by_the_wait_here() {
        // The wait here lags the drain by a third of the sockets between: it ends
        // nothing and refuses no deferral; the gateway's silence does.
        let c = ManualClock::new(0);
        let s = Duration::from_secs;
        let (mut t, l) = streaming(&c);
        t.gateway = true;
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(600));
        assert_eq!(
            verdict(&t, c.now(), &l),
            None,
            "600 s waiting on its reader"
        );
        assert!(defers(&t, c.now(), &l, Some(s(89))));
        assert!(
            !defers(&t, c.now(), &l, Some(s(90))),
            "the gateway saw nothing for 90 s"
        );
        // Its other clocks still count: the engine's silence once it is asked, max age.
        t.flow = Some(Flow::Engine(c.now()));
        t.drained = s(600);
        c.advance(s(10));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::Stalled));
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(10_000));
        assert_eq!(verdict(&t, c.now(), &l), Some(AbortReason::MaxAge));
    }

    #[test]
    fn the_engine_s_silence_excludes_the_reader_s_waits_and_keep_alives_do_not_end_it() {
        let c = ManualClock::new(0);
        let s = Duration::from_secs;
        let (mut t, _) = streaming(&c);
        assert_eq!(t.engine_silence(c.now()), Some(Duration::ZERO));
        // Asked for 3 s, then a keep-alive frame handed (no data event): waiting on the
        // reader for 2 s, then asked again.
        t.flow = Some(Flow::Engine(c.now()));
        c.advance(s(3));
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(2));
        assert_eq!(t.reader_wait(c.now()), Some(s(2)));
        assert_eq!(t.engine_silence(c.now()), Some(s(3)));
        t.drained = s(2);
        t.flow = Some(Flow::Engine(c.now()));
        c.advance(s(4));
        assert_eq!(t.reader_wait(c.now()), None);
        assert_eq!(t.engine_silence(c.now()), Some(s(7)));
        let first = waiting(&c, Duration::ZERO);
        assert_eq!(first.engine_silence(c.now()), None);
    }

    #[test]
    fn a_stall_is_deferred_only_while_the_engine_produces_and_the_reader_drains() {
        let c = ManualClock::new(0);
        let (mut t, l) = streaming(&c);
        let s = Duration::from_secs;
        // Never before the gateway first asked, nor without the sender's silence.
        assert!(!defers(&t, c.now(), &l, Some(s(10))));
        t.flow = Some(Flow::Engine(c.now()));
        assert!(!defers(&t, c.now(), &l, None));
        // The engine has been silent 4 s; the sender saw 10 s: under half, the silence
        // was the drain's.
        c.advance(s(4));
        assert!(defers(&t, c.now(), &l, Some(s(10))));
        c.advance(s(1));
        assert!(
            !defers(&t, c.now(), &l, Some(s(10))),
            "5 s of 10: the engine's"
        );
        // A data event, then waiting on the reader: deferred within the reader timeout.
        let (mut t, _) = streaming(&c);
        t.flow = Some(Flow::Reader(c.now()));
        c.advance(s(89));
        assert!(defers(&t, c.now(), &l, Some(s(10))));
        c.advance(s(1));
        assert!(!defers(&t, c.now(), &l, Some(s(10))));
        // The sender saw nothing for the reader timeout: not deferred, whatever here.
        let (mut t, _) = streaming(&c);
        t.flow = Some(Flow::Reader(c.now()));
        assert!(defers(&t, c.now(), &l, Some(s(89))));
        assert!(!defers(&t, c.now(), &l, Some(s(90))));
        // No data event yet, or no reader timeout: never.
        let mut first = waiting(&c, Duration::ZERO);
        first.flow = Some(Flow::Engine(c.now()));
        assert!(!defers(&first, c.now(), &l, Some(s(10))));
        let off = Limits {
            reader_timeout: None,
            ..l
        };
        assert!(!defers(&t, c.now(), &off, Some(s(10))));
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
        let mut t = flowing(&c);
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
        let reader = Limits {
            reader_timeout: Some(Duration::from_millis(400)),
            ..Limits::default()
        };
        assert_eq!(tick(&reader), Duration::from_millis(100));
    }
}
