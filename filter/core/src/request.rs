//! One tracked request: its clocks, its progress, its completion and its (single)
//! decision; and how Envoy's `response.code_details` / `response.flags` map to an abort
//! reason at the end of a stream.

use crate::config::Limits;
use crate::scan::{Fed, Framing, Scanner};
use crate::tracked_id::TrackedId;
use kvguard_contract::AbortReason;
use std::net::SocketAddr;

/// The value written to filter state `kvguard.outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeTag {
    /// The response completed.
    Completed,
    /// An abort was queued for this reason.
    Aborted(AbortReason),
    /// Observe mode: it would have been aborted for this reason.
    Observed(AbortReason),
    /// The filter does not track this request.
    Untracked,
}

impl OutcomeTag {
    /// `completed`, `aborted:<reason>`, `observed:<reason>` or `untracked`.
    pub fn as_string(self) -> String {
        match self {
            OutcomeTag::Completed => "completed".to_owned(),
            OutcomeTag::Aborted(r) => format!("aborted:{}", r.as_str()),
            OutcomeTag::Observed(r) => format!("observed:{}", r.as_str()),
            OutcomeTag::Untracked => "untracked".to_owned(),
        }
    }
}

/// Where a tracked request is in its life. Every transition is a method of [`Request`]
/// in this module:
///
/// ```text
///            response headers              body: [DONE] / terminal event / done:true
/// Requested ───────────────▶ Streaming ─────────────────────────────────────────▶ Complete
///     │  (end of stream)         │ upstream end of stream (body or trailers)
///     ├──────────────────────────┴──────────────────────────────────────────────▶ Ended
///     │  decide (enforce): a clock fired, or on_log found an early end
///     └──────────── Requested / Streaming / Ended ──────────────────────────────▶ Aborted
/// ```
///
/// `Complete` and `Aborted` are final. Clocks run only in `Requested` and `Streaming`;
/// the body is read only in `Streaming`. Observe mode never changes the phase: it notes
/// what it would have aborted ([`Request::observed`]) and the stream goes on.
#[derive(Debug, Clone)]
pub enum Phase {
    /// Request headers seen; the response has not started.
    Requested,
    /// The response body is being read with this scanner.
    Streaming(Scanner),
    /// The body said it is complete: never aborted.
    Complete,
    /// The upstream's end of stream passed the filter; `on_log` classifies it (an
    /// Envoy local reply after a timeout also ends the stream).
    Ended,
    /// An abort was decided for this reason (enforce mode).
    Aborted(AbortReason),
}

/// The clocks of one request, in ms (0 = off): [`Limits`] narrowed to `u32` (every
/// timeout is at most [`crate::config::MAX_TIMEOUT_MS`], 24 h), 12 bytes instead of 24
/// per tracked stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clocks {
    idle: u32,
    first_token: u32,
    max_age: u32,
}

impl Clocks {
    fn of(l: Limits) -> Self {
        let n = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        Clocks {
            idle: n(l.idle_timeout_ms),
            first_token: n(l.first_token_timeout_ms),
            max_age: n(l.max_age_ms),
        }
    }
}

/// Relative times are rebased once they reach this (ms, 24.8 days): see [`Request`].
pub const EPOCH_MS: u64 = 1 << 31;

/// `start_ms` of a request whose headers came while the host clock could not be read:
/// it starts at the next reading (later than the truth, so no clock fires early).
const START_UNKNOWN: u64 = u64::MAX;

/// `first_from` while the request body is still being uploaded: the first-token clock
/// counts from the end of the request body.
const UPLOADING: u32 = u32::MAX;

/// `first_from` once the request body ended while the clock could not be read: the next
/// tick's time is taken (later than the truth).
const UPLOAD_ENDED: u32 = u32::MAX - 1;

/// [`Request`]'s flag: its next chunk reads the clock.
const QUIET: u8 = 1;
/// [`Request`]'s flag: an idle clock was due at the previous tick.
const ARMED: u8 = 2;
/// [`Request`]'s flag: a stall was put to kvguard-control, whose first answer is awaited
/// ([`Request::ask`]); no clock fires meanwhile.
const ASKING: u8 = 4;
/// [`Request`]'s flag: kvguard-control answered the stall with no deferral: the next tick
/// cuts it, its abort already sent ([`Request::answered`]).
const UNDEFERRED: u8 = 8;
/// The flags of a stall put to kvguard-control and not deferred.
const STALL_PUT: u8 = ASKING | UNDEFERRED;
/// The flags progress clears (the others wait for an answer or a cut).
const IDLE_FLAGS: u8 = QUIET | ARMED;

/// A tracked request.
///
/// Its times are `u32` milliseconds relative to a base: its own start (`start_ms`, the
/// one absolute `u64`) plus `epoch` × [`EPOCH_MS`]. The tick rebases a stream older than
/// an epoch ([`Request::stamp`]), moving every relative time that far back (none later
/// than the truth: a time before the new base reads as the base itself), so a stream of
/// any age keeps exact clocks while the VM's own clock (which Envoy keeps for months) stays
/// `u64`. A deadline that does not fit in a `u32` never fires.
///
/// Progress is counted per chunk without reading the clock: a chunk only adds to
/// `events`. The clock is read for the first data event (the exact time to first token)
/// and for the first chunk after a tick saw none (a gap of a tick or more: its end is then
/// exact); otherwise the tick stamps the progress it finds ([`Request::stamp`]) with its
/// own time, which is no earlier than the last event itself. So the idle clock can only
/// run late, never early: a stall is detected at most one tick later than with a clock
/// read per chunk (exactly that when `idle_timeout_ms` is a multiple of `tick_ms`, as the
/// defaults are; see docs/BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct Request {
    /// The abort key.
    pub id: TrackedId,
    /// When the request headers arrived (ms, monotonic host clock).
    pub start_ms: u64,
    /// The clocks count from no earlier than this (0, or the moment enforce mode came
    /// back after observe mode had flagged the request), relative ms.
    clocks_from: u32,
    /// Until the first progress: where the first-token clock counts from (relative ms:
    /// the end of the request body; [`UPLOADING`] until then, [`UPLOAD_ENDED`] until the
    /// next tick when the clock could not be read). From the first progress stamped: the
    /// time to it (ms after the start, saturating). One field for both (a tracked stream
    /// is kept small).
    first: u32,
    /// Epochs of [`EPOCH_MS`] the relative times were moved by (17 years in all).
    epoch: u8,
    /// A mass stall held this request's close until then (relative ms; 0 = not held).
    held_until: u32,
    /// The clocks that apply to it.
    clocks: Clocks,
    /// Data events seen (the abort body's `tokens`), saturating.
    events: u32,
    /// `events` when progress was last stamped.
    stamped: u32,
    /// When the last progress was stamped (relative ms; meaningful once `events > 0`).
    last_event: u32,
    /// The largest gap between data events seen so far (relative ms).
    max_gap: u32,
    /// [`QUIET`]: a tick found no progress since the last stamp, so the next chunk reads
    /// the clock. [`ARMED`]: a tick found an idle clock (stall or first token) due and
    /// nothing has arrived since, so the next tick may cut it ([`crate::cut`]).
    /// [`ASKING`], [`UNDEFERRED`]: a stall put to kvguard-control first.
    flags: u8,
    /// Observe mode: what it would have been aborted for (its clocks are then off).
    pub observed: Option<AbortReason>,
    /// Where it is.
    pub phase: Phase,
    /// The control replica holding it (a verified stamp); boxed, as few requests have one.
    pub target: Option<Box<SocketAddr>>,
}

impl Request {
    /// A request whose headers arrived at `now_ms` (`None`: the host clock could not be
    /// read; the request then starts at the next reading).
    pub fn new(id: TrackedId, limits: Limits, now_ms: Option<u64>) -> Self {
        Request {
            id,
            start_ms: now_ms.unwrap_or(START_UNKNOWN),
            clocks_from: 0,
            first: 0,
            epoch: 0,
            held_until: 0,
            clocks: Clocks::of(limits),
            events: 0,
            stamped: 0,
            last_event: 0,
            max_gap: 0,
            flags: 0,
            phase: Phase::Requested,
            observed: None,
            target: None,
        }
    }

    /// The base of the relative times (absolute ms).
    fn base(&self) -> u64 {
        self.start_ms
            .saturating_add(u64::from(self.epoch).saturating_mul(EPOCH_MS))
    }

    /// `now_ms` relative to the base, saturating at `u32::MAX`.
    fn rel(&self, now_ms: u64) -> u32 {
        u32::try_from(now_ms.saturating_sub(self.base())).unwrap_or(u32::MAX)
    }

    /// The absolute time of relative `t`.
    fn abs(&self, t: u32) -> u64 {
        self.base().saturating_add(u64::from(t))
    }

    /// Moves the base one epoch later once `now_ms` is an epoch past it: every relative
    /// time moves back by as much (one before the new base becomes the base: later than
    /// the truth, never earlier).
    fn rebase(&mut self, now_ms: u64) {
        // (A start not known yet is the largest base: no epoch has passed.)
        let n = now_ms.saturating_sub(self.base()) / EPOCH_MS;
        if n == 0 {
            return;
        }
        let e = u32::try_from(n.saturating_mul(EPOCH_MS)).unwrap_or(u32::MAX);
        self.epoch = self
            .epoch
            .saturating_add(u8::try_from(n).unwrap_or(u8::MAX));
        self.last_event = self.last_event.saturating_sub(e);
        self.clocks_from = self.clocks_from.saturating_sub(e);
        if self.events == 0 && self.first < UPLOAD_ENDED {
            self.first = self.first.saturating_sub(e);
        }
        if self.held_until != 0 {
            // Still "held once" (0 would mean never held).
            self.held_until = self.held_until.saturating_sub(e).max(1);
        }
    }

    /// The request's start is known from `now_ms` on (if it was not: its headers came
    /// while the clock could not be read).
    fn started(&mut self, now_ms: u64) {
        if self.start_ms == START_UNKNOWN {
            self.start_ms = now_ms;
        }
    }

    /// Age at `now_ms`.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.start_ms)
    }

    /// Data events seen.
    pub fn events(&self) -> u64 {
        u64::from(self.events)
    }

    /// When the last progress was stamped (absolute ms), if any.
    pub fn last_event_ms(&self) -> Option<u64> {
        (self.events > 0).then(|| self.abs(self.last_event))
    }

    /// Time from the request to its first data event, ms, if it had one.
    pub fn first_token_ms(&self) -> Option<u64> {
        (self.events > 0).then_some(u64::from(self.first))
    }

    /// The request body follows its headers: the first-token clock waits for its end
    /// ([`Request::on_request_end`]).
    pub fn on_request_body_follows(&mut self) {
        self.first = UPLOADING;
    }

    /// The request body ended at `now_ms` (`None`: the clock could not be read; the
    /// next tick's time is taken): the first-token clock counts from there.
    pub fn on_request_end(&mut self, now_ms: Option<u64>) {
        if self.events == 0 && self.first == UPLOADING {
            self.first = UPLOAD_ENDED;
            if let Some(now) = now_ms {
                self.started(now);
                self.first = self.rel(now);
            }
        }
    }

    /// Whether the first-token clock waits for the end of the request body (the only
    /// case in which that end needs a clock reading).
    pub fn waits_for_upload(&self) -> bool {
        self.events == 0 && self.first == UPLOADING && self.clocks.first_token > 0
    }

    /// The largest gap between two data events, ms (a gap shorter than a tick may read
    /// as 0: only gaps a tick saw are measured, see [`Request`]).
    pub fn max_gap_ms(&self) -> u64 {
        u64::from(self.max_gap)
    }

    /// Whether the body said it is complete.
    pub fn complete(&self) -> bool {
        matches!(self.phase, Phase::Complete)
    }

    /// The abort decided for it, if any.
    pub fn aborted(&self) -> Option<AbortReason> {
        match self.phase {
            Phase::Aborted(r) => Some(r),
            _ => None,
        }
    }

    /// The framing of the body being read (`None` when nothing is to be read).
    pub fn reading(&self) -> Option<Framing> {
        match &self.phase {
            Phase::Streaming(s) => Some(s.framing()),
            _ => None,
        }
    }

    /// Whether `on_log` needs Envoy's end details: not once the body completed or an
    /// abort was decided (then nothing is left to classify).
    pub fn end_matters(&self) -> bool {
        !matches!(self.phase, Phase::Complete | Phase::Aborted(_))
    }

    /// Response headers: `Requested → Streaming` (or `Ended` with end of stream).
    pub fn on_response_headers(&mut self, framing: Framing, max_event_bytes: usize, eos: bool) {
        if matches!(self.phase, Phase::Requested) {
            self.phase = if eos {
                Phase::Ended
            } else {
                Phase::Streaming(Scanner::new(framing, max_event_bytes))
            };
        }
    }

    /// Feeds a body chunk (for an opaque body, only `len` counts: any byte is progress);
    /// returns what the scanner found and whether the clock must be read for it
    /// ([`Request::mark`]). `Streaming → Complete` when the body says so,
    /// `Streaming → Ended` at the upstream's end of stream.
    /// `words`: the event names ([`crate::config::Config::event_words`]).
    pub fn on_body<W: AsRef<[u8]>>(
        &mut self,
        chunk: &[u8],
        len: usize,
        end_of_stream: bool,
        words: &[W],
    ) -> (Fed, bool) {
        let Phase::Streaming(s) = &mut self.phase else {
            return (Fed::default(), false);
        };
        let mut fed = Fed::default();
        if s.framing() == Framing::Opaque {
            // Opaque bodies: any bytes are progress, so the clocks do not fire on a
            // stream the filter cannot read (compressed SSE).
            if len > 0 {
                fed.events = 1;
            }
        } else {
            fed = s.feed_in(chunk, words, &mut |_| {});
            if end_of_stream && !fed.completed {
                let last = s.finish_in(words, &mut |_| {});
                fed.events += last.events;
                fed.oversized += last.oversized;
                fed.malformed += last.malformed;
                fed.completed |= last.completed;
            }
        }
        let clock = fed.events > 0 && self.progress(fed.events);
        if fed.completed {
            self.phase = Phase::Complete;
        } else if end_of_stream {
            self.phase = Phase::Ended;
        }
        (fed, clock)
    }

    /// A body chunk the host could not hand over: counted as progress (an unreadable
    /// chunk is no sign of a stall), `Streaming → Ended` at end of stream. Returns whether
    /// the clock must be read for it ([`Request::mark`]).
    pub fn on_unreadable_body(&mut self, end_of_stream: bool) -> bool {
        if !matches!(self.phase, Phase::Streaming(_)) {
            return false;
        }
        let clock = self.progress(1);
        if end_of_stream {
            self.phase = Phase::Ended;
        }
        clock
    }

    /// The response trailers passed: the upstream's end of stream (`Streaming → Ended`).
    pub fn on_trailers(&mut self) {
        if matches!(self.phase, Phase::Streaming(_) | Phase::Requested) {
            self.phase = Phase::Ended;
        }
    }

    /// Counts progress (no clock). Returns whether this progress needs the exact time:
    /// the first data event, or the first after a tick saw none.
    fn progress(&mut self, events: u32) -> bool {
        let first = self.events == 0;
        self.events = self.events.saturating_add(events);
        first || self.flags & QUIET != 0
    }

    /// The exact time of the progress just counted (when [`Request::on_body`] asked).
    pub fn mark(&mut self, now_ms: u64) {
        self.started(now_ms);
        self.rebase(now_ms);
        let t = self.rel(now_ms);
        if self.stamped == 0 {
            // Nothing stamped yet: this is the first progress.
            self.first = u32::try_from(self.age_ms(now_ms)).unwrap_or(u32::MAX);
        } else {
            self.max_gap = self.max_gap.max(t.saturating_sub(self.last_event));
        }
        self.last_event = self.last_event.max(t);
        self.stamped = self.events;
        self.flags &= !IDLE_FLAGS;
        self.held_until = 0;
    }

    /// The tick (or a decision): stamps progress counted since the last stamp with
    /// `now_ms`, which is no earlier than that progress. A tick that finds none marks the
    /// request quiet: its next chunk reads the clock.
    pub fn stamp(&mut self, now_ms: u64) {
        self.started(now_ms);
        self.rebase(now_ms);
        if self.events == 0 && self.first == UPLOAD_ENDED {
            self.first = self.rel(now_ms);
        }
        if self.events != self.stamped {
            if self.stamped == 0 {
                // The first progress, counted while the clock could not be read.
                self.first = u32::try_from(self.age_ms(now_ms)).unwrap_or(u32::MAX);
            }
            self.last_event = self.last_event.max(self.rel(now_ms));
            self.stamped = self.events;
            self.flags &= !IDLE_FLAGS;
            self.held_until = 0;
        } else if self.events > 0 {
            self.flags |= QUIET;
        }
    }

    /// The reason a clock fired at `now_ms`, if one did. The earliest deadline wins (on a
    /// tie, max age: the request's own bound). Progress must be stamped first
    /// ([`Request::stamp`]).
    pub fn due(&self, now_ms: u64) -> Option<AbortReason> {
        // A clock that is off (0) is never considered below: with all off, none fires.
        if !matches!(self.phase, Phase::Requested | Phase::Streaming(_)) || self.observed.is_some()
        {
            return None;
        }
        let now = self.rel(now_ms);
        if now < self.held_until {
            return None;
        }
        let from = self.clocks_from;
        let mut best: Option<(u32, AbortReason)> = None;
        // A deadline past what a `u32` holds (only a clock waiting for something, such
        // as the end of the upload) never fires.
        let mut consider = |start: u32, timeout: u32, reason: AbortReason| {
            let Some(deadline) = start.checked_add(timeout).filter(|d| *d < u32::MAX) else {
                return;
            };
            let earlier = match best {
                Some((d, _)) => deadline < d,
                None => true,
            };
            if now >= deadline && earlier {
                best = Some((deadline, reason));
            }
        };
        let c = self.clocks;
        if c.max_age > 0 {
            consider(from, c.max_age, AbortReason::MaxAge);
        }
        if self.events == 0 {
            if c.first_token > 0 {
                consider(
                    self.first.max(from),
                    c.first_token,
                    AbortReason::FirstTokenTimeout,
                );
            }
        } else if c.idle > 0 {
            consider(self.last_event.max(from), c.idle, AbortReason::Stalled);
        }
        best.map(|(_, r)| r)
    }

    /// A mass stall: the stall close waits one more idle window (once per stall; new
    /// progress ends the hold). Returns false when it was already held once.
    pub fn hold(&mut self, now_ms: u64) -> bool {
        if self.held_until != 0 {
            return false;
        }
        // One more window of the clock that fired.
        let window = if self.events == 0 {
            self.clocks.first_token
        } else {
            self.clocks.idle
        };
        self.held_until = self.rel(now_ms).saturating_add(window).max(1);
        true
    }

    /// Whether an idle clock (stall, or first token) runs for it: the streams the
    /// mass-stall valve counts ([`crate::cut`]).
    pub fn idle_clock_on(&self) -> bool {
        if !matches!(self.phase, Phase::Requested | Phase::Streaming(_)) || self.observed.is_some()
        {
            return false;
        }
        if self.events == 0 {
            self.clocks.first_token > 0 && self.first < UPLOAD_ENDED
        } else {
            self.clocks.idle > 0
        }
    }

    /// Whether a mass stall holds this request's close.
    pub fn held(&self) -> bool {
        self.held_until != 0
    }

    /// An idle clock (stall or first token) is due at this tick: true when it was due
    /// at the previous tick too and nothing arrived since (the stream may be cut), else
    /// arms it for the next tick. Progress disarms it ([`Request::stamp`]).
    pub fn confirm_idle(&mut self) -> bool {
        let armed = self.flags & ARMED != 0;
        self.flags |= ARMED;
        armed
    }

    /// A stall is put to kvguard-control before the stream is cut: until its first answer
    /// ([`Request::answered`]) no clock fires.
    pub fn ask(&mut self) {
        self.flags |= ASKING;
    }

    /// Whether kvguard-control's answer to a stall is awaited.
    pub fn asking(&self) -> bool {
        self.flags & ASKING != 0
    }

    /// kvguard-control answered the stall at `now_ms`. Deferred (its engine produces, its
    /// reader drains): the stream is kept, and its idle clock may fire again one idle
    /// window later (the stall is asked about again then, unless progress came first).
    /// Anything else: the next tick cuts it ([`Request::undeferred`]).
    pub fn answered(&mut self, deferred: bool, now_ms: u64) {
        self.flags &= !(ASKING | ARMED);
        if deferred {
            self.held_until = 0;
            self.hold(now_ms);
        } else {
            self.flags |= UNDEFERRED;
        }
    }

    /// Whether kvguard-control answered its stall with no deferral and it is still open
    /// to cut (its end held, [`Request::end_held`], included).
    pub fn undeferred(&self) -> bool {
        self.flags & UNDEFERRED != 0 && !matches!(self.phase, Phase::Complete | Phase::Aborted(_))
    }

    /// The upstream's end passed (`→ Ended`, not complete) while a stall of this stream
    /// was put to kvguard-control and not deferred (its answer awaited, or no deferral):
    /// kvguard-control ends a stream it does not defer with a final event, which may pass
    /// before its answer or the next tick. Returns whether the end is held: it then
    /// counts as answered with no deferral, and the next tick cuts the stream. A body
    /// that completed (the engine finished) is never held.
    pub fn end_held(&mut self) -> bool {
        let held = self.flags & STALL_PUT != 0 && matches!(self.phase, Phase::Ended);
        if held {
            self.flags |= UNDEFERRED;
        }
        held
    }

    /// Its idle window, ms (0 = off).
    pub fn idle_window(&self) -> u32 {
        self.clocks.idle
    }

    /// Enforce mode: records the abort (`→ Aborted`) unless one exists or the request
    /// completed. Observe mode: notes it once, the phase is unchanged. Returns whether
    /// it was recorded (one decision per request, first reason wins, completed never).
    pub fn decide(&mut self, reason: AbortReason, observe: bool) -> bool {
        match self.phase {
            Phase::Complete | Phase::Aborted(_) => false,
            _ if observe => {
                if self.observed.is_some() {
                    return false;
                }
                self.observed = Some(reason);
                true
            }
            _ => {
                self.phase = Phase::Aborted(reason);
                true
            }
        }
    }

    /// Enforce mode is back: what observe mode flagged starts its clocks afresh at
    /// `now_ms` (no request is closed just because it was flagged while observed).
    pub fn restart_clocks(&mut self, now_ms: u64) {
        if self.observed.take().is_some() {
            self.clocks_from = self.rel(now_ms);
            self.held_until = 0;
            self.flags &= !(ARMED | UNDEFERRED);
        }
    }

    /// The outcome at the end (or `None` while nothing was decided or completed).
    pub fn outcome(&self) -> Option<OutcomeTag> {
        match (self.aborted(), self.observed) {
            (Some(r), _) => Some(OutcomeTag::Aborted(r)),
            (None, Some(r)) => Some(OutcomeTag::Observed(r)),
            (None, None) => self.complete().then_some(OutcomeTag::Completed),
        }
    }
}

/// `response.flags` bits (Envoy's core response flags, `1 << index`).
pub mod flags {
    /// UT: upstream request timeout.
    pub const UT: u64 = 0x4;
    /// LR: connection local reset.
    pub const LR: u64 = 0x8;
    /// UR: upstream remote reset.
    pub const UR: u64 = 0x10;
    /// UC: upstream connection termination.
    pub const UC: u64 = 0x40;
    /// DC: downstream connection termination.
    pub const DC: u64 = 0x4000;
    /// URX: upstream retry limit exceeded.
    pub const URX: u64 = 0x8000;
    /// SI: stream idle timeout.
    pub const SI: u64 = 0x10000;
    /// UMSDR: upstream max stream duration reached.
    pub const UMSDR: u64 = 0x80000;
    /// DT: duration timeout.
    pub const DT: u64 = 0x400000;
    /// UPE: upstream protocol error.
    pub const UPE: u64 = 0x800000;
    /// DR: downstream remote reset.
    pub const DR: u64 = 0x10000000;
}

/// How a tracked request that reached `on_log` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Completed: no abort.
    Completed,
    /// Ended early: abort for this reason.
    Abort(AbortReason),
    /// Nothing the body, the details or the flags say explains the end (`ended`: an end
    /// of stream passed the filter): a local reply, Envoy's or another filter's, or a
    /// route's `direct_response`. [`crate::engine::Engine::on_log`] settles it by whether
    /// the request reached an upstream.
    Unnamed {
        /// An end of stream passed the filter (its own or a local reply's).
        ended: bool,
    },
}

/// Classifies the end of a request from what it saw and from Envoy's
/// `response.code_details` and `response.flags`.
///
/// - The body said it was complete → completed.
/// - The upstream's own end of stream (`via_upstream`) → completed.
/// - A client gone (`downstream_*` details, flags DC/DR) → `downstream_reset`.
/// - Envoy timeouts (details containing `timeout`, flags UT/SI/DT/UMSDR) → `timeout`,
///   even when Envoy sent a local reply (its end of stream is not the upstream's).
/// - Upstream resets (`upstream_*` details, flags UR/UC/LR/URX/UPE) → `upstream_reset`.
/// - Anything else (a local reply, Envoy's or a filter's, `direct_response`...) →
///   [`End::Unnamed`]: the engine asks whether the request reached an upstream.
pub fn classify_end(req: &Request, details: &[u8], flag_bits: u64) -> End {
    if req.complete() {
        return End::Completed;
    }
    let ended = matches!(req.phase, Phase::Ended);
    if ended && details == b"via_upstream" {
        return End::Completed;
    }
    if flag_bits & (flags::DC | flags::DR) != 0 || details.starts_with(b"downstream_") {
        return End::Abort(AbortReason::DownstreamReset);
    }
    if memchr::memmem::find(details, b"timeout").is_some()
        || flag_bits & (flags::UT | flags::SI | flags::DT | flags::UMSDR) != 0
    {
        return End::Abort(AbortReason::Timeout);
    }
    if details.starts_with(b"upstream_")
        || flag_bits & (flags::UR | flags::UC | flags::LR | flags::URX | flags::UPE) != 0
    {
        return End::Abort(AbortReason::UpstreamReset);
    }
    End::Unnamed { ended }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::DEFAULT_EVENT_WORDS;

    /// A chunk at `now` as the engine feeds it: the exact time when the request asks for
    /// it, else stamped right away (as a tick at `now` would).
    fn body_at(r: &mut Request, chunk: &[u8], len: usize, eos: bool, now: u64) -> Fed {
        let (fed, clock) = r.on_body(chunk, len, eos, &DEFAULT_EVENT_WORDS);
        if clock {
            r.mark(now);
        } else {
            r.stamp(now);
        }
        fed
    }

    fn unreadable_at(r: &mut Request, eos: bool, now: u64) {
        if r.on_unreadable_body(eos) {
            r.mark(now);
        } else {
            r.stamp(now);
        }
    }

    fn req(limits: Limits) -> Request {
        Request::new(TrackedId::try_new(b"r").unwrap(), limits, Some(1000))
    }

    /// The boxed request is most of a tracked stream's memory (docs/BENCHMARKS.md, issue
    /// 39): on wasm32 it fits wasi-libc's 112-byte block (a 4-byte header, 16-byte
    /// granules), its id and its scanner inline (a UUID costs no block of its own).
    #[cfg(target_pointer_width = "32")]
    #[test]
    fn a_tracked_request_fits_one_112_byte_block_on_wasm32() {
        assert!(core::mem::size_of::<Request>() + 4 <= 112);
        assert!(core::mem::size_of::<TrackedId>() <= 20);
        assert!(core::mem::size_of::<Phase>() <= 24);
    }

    const L: Limits = Limits {
        idle_timeout_ms: 100,
        first_token_timeout_ms: 0,
        max_age_ms: 1000,
    };

    #[test]
    fn idle_starts_after_first_event() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        assert_eq!(r.due(1900), None); // no event yet, first-token off
        body_at(&mut r, b": keep-alive\n\n", 14, false, 1500);
        assert_eq!(r.due(1990), None); // comments are not progress
        body_at(&mut r, b"data: {}\n\n", 10, false, 1500);
        assert_eq!(r.last_event_ms(), Some(1500));
        assert_eq!(r.due(1599), None);
        assert_eq!(r.due(1600), Some(AbortReason::Stalled));
        body_at(&mut r, b"data: x\n\n", 9, false, 1590);
        assert_eq!(r.due(1600), None);
    }

    #[test]
    fn first_token_and_max_age() {
        let mut r = req(Limits {
            first_token_timeout_ms: 300,
            ..L
        });
        assert_eq!(r.due(1299), None);
        assert_eq!(r.due(1300), Some(AbortReason::FirstTokenTimeout));
        // Both due: the earlier deadline wins.
        assert_eq!(r.due(5000), Some(AbortReason::FirstTokenTimeout));
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: x\n\n", 9, false, 1200);
        assert_eq!(r.due(1299), None);
        assert_eq!(r.due(1300), Some(AbortReason::Stalled));
        let mut r = req(Limits {
            idle_timeout_ms: 0,
            ..L
        });
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: x\n\n", 9, false, 1100);
        assert_eq!(r.due(1999), None);
        assert_eq!(r.due(2000), Some(AbortReason::MaxAge));
        // Max age fires even with steady progress.
        body_at(&mut r, b"data: x\n\n", 9, false, 1999);
        assert_eq!(r.due(2000), Some(AbortReason::MaxAge));
    }

    #[test]
    fn on_a_tie_max_age_is_the_reason() {
        // First token and max age both due at 1500.
        let r = req(Limits {
            idle_timeout_ms: 0,
            first_token_timeout_ms: 500,
            max_age_ms: 500,
        });
        assert_eq!(r.due(1500), Some(AbortReason::MaxAge));
        // Idle and max age both due at 2000.
        let mut r = req(Limits {
            idle_timeout_ms: 400,
            first_token_timeout_ms: 0,
            max_age_ms: 1000,
        });
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: x\n\n", 9, false, 1600);
        assert_eq!(r.due(2000), Some(AbortReason::MaxAge));
    }

    #[test]
    fn a_request_without_data_events_has_no_first_token_time() {
        let mut r = req(L);
        assert_eq!(r.first_token_ms(), None);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b": keep-alive\n\n", 14, false, 1200);
        assert_eq!(r.first_token_ms(), None);
        body_at(&mut r, b"data: x\n\n", 9, false, 1300);
        assert_eq!(r.first_token_ms(), Some(300));
    }

    #[test]
    fn a_chunk_without_data_events_never_asks_for_the_clock() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        // Before the first event.
        assert_eq!(
            r.on_body(b": ping\n\n", 8, false, &DEFAULT_EVENT_WORDS),
            (Fed::default(), false)
        );
        body_at(&mut r, b"data: x\n\n", 9, false, 1100);
        // After a tick that found no progress (the next event reads the clock).
        r.stamp(1200);
        assert_eq!(
            r.on_body(b": ping\n\n", 8, false, &DEFAULT_EVENT_WORDS),
            (Fed::default(), false)
        );
        assert!(r.on_body(b"data: y\n\n", 9, false, &DEFAULT_EVENT_WORDS).1);
    }

    #[test]
    fn an_empty_opaque_chunk_is_no_progress() {
        let mut r = req(Limits {
            first_token_timeout_ms: 300,
            ..L
        });
        r.on_response_headers(Framing::Opaque, 1024, false);
        assert_eq!(
            r.on_body(&[], 0, false, &DEFAULT_EVENT_WORDS),
            (Fed::default(), false)
        );
        r.stamp(1200);
        assert_eq!(r.last_event_ms(), None);
        // The first-token clock still fires on a body of empty chunks.
        assert_eq!(r.due(1300), Some(AbortReason::FirstTokenTimeout));
        assert_eq!(r.on_body(&[], 0, true, &DEFAULT_EVENT_WORDS).0.events, 0);
        assert_eq!(r.events(), 0);
    }

    #[test]
    fn an_ndjson_last_line_is_counted_at_end_of_stream_whatever_it_holds() {
        // Oversized: still progress, counted as oversized.
        let mut r = req(L);
        r.on_response_headers(Framing::Ndjson, 16, false);
        let fed = body_at(&mut r, b"{\"a\":1}\n{\"b\":\"0123456789\"}", 26, true, 1100);
        assert_eq!((fed.events, fed.oversized, fed.malformed), (2, 1, 0));
        // Malformed: progress, counted as malformed.
        let mut r = req(L);
        r.on_response_headers(Framing::Ndjson, 1024, false);
        let fed = body_at(&mut r, b"{\"a\":1}\n{\"b\":", 14, true, 1100);
        assert_eq!((fed.events, fed.oversized, fed.malformed), (2, 0, 1));
        assert_eq!(r.events(), 2);
        assert!(matches!(r.phase, Phase::Ended));
    }

    #[test]
    fn all_off_never_fires() {
        let r = req(Limits {
            idle_timeout_ms: 0,
            first_token_timeout_ms: 0,
            max_age_ms: 0,
        });
        assert_eq!(r.due(u64::MAX), None);
    }

    #[test]
    fn one_decision_first_wins_and_completed_never() {
        let mut r = req(L);
        assert!(r.decide(AbortReason::Stalled, false));
        assert!(!r.decide(AbortReason::DownstreamReset, false));
        assert_eq!(r.aborted(), Some(AbortReason::Stalled));
        assert_eq!(r.due(999_999), None);
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        let fed = body_at(&mut r, b"data: [DONE]\n\n", 14, false, 1001);
        assert!(fed.completed && r.complete());
        assert!(!r.decide(AbortReason::MaxAge, false));
        assert_eq!(r.due(999_999), None);
        assert_eq!(
            classify_end(&r, b"downstream_remote_disconnect", flags::DC),
            End::Completed
        );
    }

    #[test]
    fn opaque_bodies_count_bytes_as_progress() {
        let mut r = req(L);
        r.on_response_headers(Framing::Opaque, 1024, false);
        body_at(&mut r, &[], 5, false, 1200);
        assert_eq!(r.last_event_ms(), Some(1200));
        assert!(!r.complete());
        body_at(&mut r, &[], 0, true, 1300);
        assert!(matches!(r.phase, Phase::Ended));
        assert_eq!(r.due(u64::MAX), None);
    }

    #[test]
    fn ndjson_last_line_without_newline_completes() {
        let mut r = req(L);
        r.on_response_headers(Framing::Ndjson, 1024, false);
        body_at(&mut r, b"{\"done\":false}\n{\"done\":", 0, false, 1100);
        assert!(!r.complete());
        body_at(&mut r, b"true}", 0, true, 1200);
        assert!(r.complete());
        assert_eq!(r.events(), 2);
    }

    #[test]
    fn end_classification() {
        let mut r = req(L);
        assert_eq!(
            classify_end(&r, b"downstream_remote_disconnect", flags::DC),
            End::Abort(AbortReason::DownstreamReset)
        );
        assert_eq!(
            classify_end(&r, b"", flags::DR),
            End::Abort(AbortReason::DownstreamReset)
        );
        assert_eq!(
            classify_end(
                &r,
                b"upstream_reset_after_response_started{remote_reset}",
                flags::UR
            ),
            End::Abort(AbortReason::UpstreamReset)
        );
        assert_eq!(
            classify_end(&r, b"stream_idle_timeout", flags::SI),
            End::Abort(AbortReason::Timeout)
        );
        assert_eq!(classify_end(&r, b"", 0), End::Unnamed { ended: false });
        // Envoy's local reply for a route timeout passed the filter with end of stream.
        r.on_response_headers(Framing::Opaque, 1024, true);
        assert_eq!(
            classify_end(&r, b"response_timeout", flags::UT),
            End::Abort(AbortReason::Timeout)
        );
        assert_eq!(
            classify_end(
                &r,
                b"upstream_reset_before_response_started{connection_termination}",
                flags::UC
            ),
            End::Abort(AbortReason::UpstreamReset)
        );
        assert_eq!(classify_end(&r, b"via_upstream", 0), End::Completed);
        assert_eq!(classify_end(&r, b"via_upstream", flags::DC), End::Completed);
        assert_eq!(
            classify_end(&r, b"direct_response", 0),
            End::Unnamed { ended: true }
        );
    }

    #[test]
    fn each_sign_of_an_early_end_names_it_alone() {
        let r = req(L);
        let cases = [
            (flags::DC, AbortReason::DownstreamReset),
            (flags::DR, AbortReason::DownstreamReset),
            (flags::UT, AbortReason::Timeout),
            (flags::SI, AbortReason::Timeout),
            (flags::DT, AbortReason::Timeout),
            (flags::UMSDR, AbortReason::Timeout),
            (flags::UR, AbortReason::UpstreamReset),
            (flags::UC, AbortReason::UpstreamReset),
            (flags::LR, AbortReason::UpstreamReset),
            (flags::URX, AbortReason::UpstreamReset),
            (flags::UPE, AbortReason::UpstreamReset),
        ];
        for (flag, reason) in cases {
            assert_eq!(classify_end(&r, b"", flag), End::Abort(reason), "{flag:#x}");
        }
        for (details, reason) in [
            (
                &b"downstream_remote_disconnect"[..],
                AbortReason::DownstreamReset,
            ),
            (b"stream_idle_timeout", AbortReason::Timeout),
            (b"response_timeout", AbortReason::Timeout),
            (
                b"upstream_reset_before_response_started{overflow}",
                AbortReason::UpstreamReset,
            ),
        ] {
            assert_eq!(
                classify_end(&r, details, 0),
                End::Abort(reason),
                "{}",
                String::from_utf8_lossy(details)
            );
        }
    }

    #[test]
    fn outcome_strings() {
        assert_eq!(OutcomeTag::Completed.as_string(), "completed");
        assert_eq!(OutcomeTag::Untracked.as_string(), "untracked");
        assert_eq!(
            OutcomeTag::Aborted(AbortReason::Stalled).as_string(),
            "aborted:stalled"
        );
        assert_eq!(
            OutcomeTag::Observed(AbortReason::MaxAge).as_string(),
            "observed:max_age"
        );
    }

    #[test]
    fn unreadable_chunks_are_progress() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1100);
        unreadable_at(&mut r, false, 1190);
        assert_eq!(r.due(1200), None, "an unreadable chunk is no stall");
        assert_eq!(r.due(1290), Some(AbortReason::Stalled));
        unreadable_at(&mut r, true, 1200);
        assert!(matches!(r.phase, Phase::Ended));
    }

    #[test]
    fn trailers_end_the_stream() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1100);
        r.on_trailers();
        assert_eq!(r.due(u64::MAX), None);
        assert_eq!(classify_end(&r, b"via_upstream", 0), End::Completed);
    }

    #[test]
    fn observe_notes_once_and_enforce_restarts_the_clocks() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1100);
        assert_eq!(r.due(1200), Some(AbortReason::Stalled));
        assert!(r.decide(AbortReason::Stalled, true));
        assert!(!r.decide(AbortReason::DownstreamReset, true));
        assert!(r.reading().is_some(), "observed: still read");
        assert_eq!(r.due(5000), None, "observed: clocks off");
        assert_eq!(
            r.outcome(),
            Some(OutcomeTag::Observed(AbortReason::Stalled))
        );
        r.restart_clocks(5000);
        assert_eq!(r.observed, None);
        assert_eq!(r.due(5099), None);
        assert_eq!(r.due(5100), Some(AbortReason::Stalled));
        // Max age restarts too.
        assert_eq!(r.age_ms(6000), 5000);
    }

    #[test]
    fn a_hold_delays_once_and_progress_ends_it() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1100);
        assert!(!r.held());
        assert!(r.hold(1200));
        assert!(r.held());
        assert!(!r.hold(1250));
        assert_eq!(r.due(1299), None);
        assert_eq!(r.due(1300), Some(AbortReason::Stalled));
        body_at(&mut r, b"data: {}\n\n", 10, false, 1250);
        assert!(!r.held());
    }

    #[test]
    fn chunks_read_no_clock_and_the_tick_stamps_them_never_early() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        // The first event asks for the clock (the exact time to first token).
        let (_, clock) = r.on_body(b"data: {}\n\n", 10, false, &DEFAULT_EVENT_WORDS);
        assert!(clock);
        r.mark(1010);
        assert_eq!(r.first_token_ms(), Some(10));
        // Further chunks do not, until a tick finds none.
        for _ in 0..5 {
            assert!(
                !r.on_body(b"data: {}\n\n", 10, false, &DEFAULT_EVENT_WORDS)
                    .1
            );
        }
        // The tick at 1240 stamps them with its own time: the idle clock counts from
        // there (late, never early, by less than a tick).
        r.stamp(1240);
        assert_eq!(r.last_event_ms(), Some(1240));
        assert_eq!(r.due(1339), None);
        assert_eq!(r.due(1340), Some(AbortReason::Stalled));
        // A tick with no progress: the next chunk reads the clock, and its gap is measured.
        r.stamp(1300);
        assert!(
            r.on_body(b"data: {}\n\n", 10, false, &DEFAULT_EVENT_WORDS)
                .1
        );
        r.mark(1330);
        assert_eq!((r.last_event_ms(), r.max_gap_ms()), (Some(1330), 90));
        assert_eq!(r.events(), 7);
    }

    #[test]
    fn relative_clocks_survive_a_vm_older_than_49_7_days() {
        // The VM's monotonic clock is past u32::MAX ms (49.7 days): relative u32 times
        // from the stream's own start still work.
        let start = u64::from(u32::MAX) + 123_456;
        let mut r = Request::new(TrackedId::try_new(b"w").unwrap(), L, Some(start));
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, start + 50);
        assert_eq!(r.first_token_ms(), Some(50));
        assert_eq!(r.last_event_ms(), Some(start + 50));
        assert_eq!(r.due(start + 149), None);
        assert_eq!(r.due(start + 150), Some(AbortReason::Stalled));
        assert_eq!(r.age_ms(start + 1_000), 1_000);
        assert_eq!(
            r.age_ms(much_later_than(start)),
            much_later_than(start) - start
        );
    }

    fn much_later_than(t: u64) -> u64 {
        t + u64::from(u32::MAX) + 10_000
    }

    /// Issue 27.4: a stream older than 49.7 days (its relative `u32` times saturated)
    /// was due every tick; the tick now rebases it, and its clocks stay exact.
    #[test]
    fn a_stream_older_than_49_7_days_is_cut_only_when_its_clocks_say() {
        let idle_only = Limits { max_age_ms: 0, ..L };
        let mut r = Request::new(TrackedId::try_new(b"o").unwrap(), idle_only, Some(1_000));
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1_000);
        // A stream that keeps flowing, one event every 50 ms, stamped by ticks of 50 ms,
        // read over more than 49.7 days (sampled: every tick near the epoch edges).
        let end = much_later_than(1_000);
        let edge = 1_000 + EPOCH_MS;
        let times = (1..=400u64)
            .map(|k| k * 10_000_000)
            .chain((0..40).map(|k| edge - 1_000 + k * 50))
            .chain((0..40).map(|k| end - 2_000 + k * 50));
        let mut times: Vec<u64> = times.collect();
        times.sort_unstable();
        let mut t = 1_000;
        for next in times {
            t = next;
            // A tick at `t`: the progress since the last is stamped now.
            body_at(&mut r, b"data: {}\n\n", 10, false, t);
            assert_eq!(r.due(t), None, "cut at {t} while flowing");
            assert_eq!(r.due(t + 99), None);
            assert_eq!(r.due(t + 100), Some(AbortReason::Stalled));
        }
        assert_eq!(r.last_event_ms(), Some(t));
        assert_eq!(r.age_ms(t), t - 1_000);
        // First token time is measured from the start, whenever it comes.
        let mut r = Request::new(TrackedId::try_new(b"f").unwrap(), idle_only, Some(1_000));
        r.on_response_headers(Framing::Sse, 1024, false);
        r.stamp(end - 10);
        body_at(&mut r, b"data: {}\n\n", 10, false, end);
        // (Saturated at 49.7 days: a histogram value.)
        assert_eq!(r.first_token_ms(), Some(u64::from(u32::MAX)));
        assert_eq!(r.due(end + 99), None);
        assert_eq!(r.due(end + 100), Some(AbortReason::Stalled));
        // Max age still fires once.
        let mut r = Request::new(TrackedId::try_new(b"m").unwrap(), L, Some(1_000));
        r.stamp(end);
        assert_eq!(r.due(end), Some(AbortReason::MaxAge));
    }

    /// The rebase moves the first-token start with the rest (a sentinel stays one), and
    /// keeps "held once" as it was.
    #[test]
    fn a_rebase_keeps_the_first_token_clock_and_the_hold() {
        let l = Limits {
            idle_timeout_ms: 0,
            first_token_timeout_ms: 300,
            max_age_ms: 0,
        };
        let later = 1_000 + EPOCH_MS + 10;
        // The upload ended at +100: after the rebase the clock counts from the new base
        // (later than the truth), not from +100 past it.
        let mut r = req(l);
        r.on_request_body_follows();
        r.on_request_end(Some(1_100));
        r.stamp(later);
        assert!(!r.held(), "never held");
        assert_eq!(r.due(later + 289), None);
        assert_eq!(r.due(later + 290), Some(AbortReason::FirstTokenTimeout));
        // The end came while the clock could not be read: the next tick's time, after the
        // rebase too.
        let mut r = req(l);
        r.on_request_body_follows();
        r.on_request_end(None);
        r.stamp(later);
        assert_eq!(r.due(later + 299), None);
        assert_eq!(r.due(later + 300), Some(AbortReason::FirstTokenTimeout));
        // A deadline that reaches what a `u32` holds never fires, even when the time
        // saturates (no tick rebased it).
        let mut r = req(Limits {
            first_token_timeout_ms: 1,
            ..l
        });
        r.on_request_body_follows();
        r.on_request_end(None);
        assert_eq!(r.due(1_000 + u64::from(u32::MAX) + 5), None);
        // Held once stays held once.
        let mut r = req(l);
        assert!(r.hold(1_200));
        r.stamp(later);
        assert!(r.held());
        assert!(!r.hold(later));
    }

    /// Issue 27.7: the valve's population is what may stall: a first-token clock that
    /// runs (not while the upload goes on, nor before its end has a time), an idle clock
    /// that is on, in a phase with clocks, not observed.
    #[test]
    fn idle_clock_on_counts_what_may_stall() {
        let ft = Limits {
            idle_timeout_ms: 0,
            first_token_timeout_ms: 300,
            max_age_ms: 0,
        };
        assert!(req(ft).idle_clock_on());
        let mut r = req(ft);
        r.on_request_body_follows();
        assert!(!r.idle_clock_on(), "uploading");
        r.on_request_end(None);
        assert!(!r.idle_clock_on(), "its start is the next tick's");
        r.stamp(1_500);
        assert!(r.idle_clock_on());
        // First-token clock off; idle clock off once streaming.
        let off = Limits {
            first_token_timeout_ms: 0,
            ..ft
        };
        let mut r = req(off);
        assert!(!r.idle_clock_on());
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1_100);
        assert!(!r.idle_clock_on(), "idle_timeout_ms 0");
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        body_at(&mut r, b"data: {}\n\n", 10, false, 1_100);
        assert!(r.idle_clock_on());
        assert!(r.decide(AbortReason::Stalled, true));
        assert!(!r.idle_clock_on(), "observed");
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, true);
        assert!(!r.idle_clock_on(), "ended");
    }

    /// A first progress counted while the clock could not be read (no mark) gets its time
    /// from the tick that stamps it; later stamps leave it.
    #[test]
    fn the_first_progress_without_a_clock_is_timed_by_the_tick() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024, false);
        assert!(
            r.on_body(b"data: {}\n\n", 10, false, &DEFAULT_EVENT_WORDS)
                .1
        );
        r.stamp(1_070);
        assert_eq!(r.first_token_ms(), Some(70));
        r.on_body(b"data: {}\n\n", 10, false, &DEFAULT_EVENT_WORDS);
        r.stamp(1_090);
        assert_eq!(r.first_token_ms(), Some(70));
        assert_eq!(r.last_event_ms(), Some(1_090));
    }

    /// Issue 27.4: a request whose headers came while the clock could not be read starts
    /// at the next reading, not at a stale or zero fallback (which made it look days old).
    #[test]
    fn a_request_started_without_a_clock_reading_is_never_old_too_early() {
        let l = Limits {
            first_token_timeout_ms: 300,
            ..L
        };
        let mut r = Request::new(TrackedId::try_new(b"u").unwrap(), l, None);
        assert_eq!(r.age_ms(5_000_000), 0);
        assert_eq!(r.due(5_000_000), None);
        r.stamp(5_000_000);
        assert_eq!(r.due(5_000_299), None);
        assert_eq!(r.due(5_000_300), Some(AbortReason::FirstTokenTimeout));
        assert_eq!(r.due(5_001_000), Some(AbortReason::FirstTokenTimeout));
        assert_eq!(r.age_ms(5_000_100), 100);
    }

    /// Issue 27.9: the first-token clock counts from the end of the request body.
    #[test]
    fn the_first_token_clock_waits_for_the_end_of_the_upload() {
        let l = Limits {
            first_token_timeout_ms: 300,
            max_age_ms: 0,
            ..L
        };
        let mut r = req(l);
        r.on_request_body_follows();
        assert!(r.waits_for_upload());
        // A slow upload: 10 s, no first-token timeout meanwhile.
        assert_eq!(r.due(11_000), None);
        r.on_request_end(Some(11_000));
        assert!(!r.waits_for_upload());
        assert_eq!(r.due(11_299), None);
        assert_eq!(r.due(11_300), Some(AbortReason::FirstTokenTimeout));
        // A second end changes nothing.
        r.on_request_end(Some(20_000));
        assert_eq!(r.due(11_300), Some(AbortReason::FirstTokenTimeout));
        // An end seen while the clock could not be read counts from the next tick.
        let mut r = req(l);
        r.on_request_body_follows();
        r.on_request_end(None);
        assert!(!r.waits_for_upload());
        assert_eq!(r.due(50_000), None);
        r.stamp(50_000);
        assert_eq!(r.due(50_299), None);
        assert_eq!(r.due(50_300), Some(AbortReason::FirstTokenTimeout));
        // Without a first-token clock the end needs no clock reading.
        let mut r = req(L);
        r.on_request_body_follows();
        assert!(!r.waits_for_upload());
    }

    #[test]
    fn a_tracked_request_is_small() {
        // docs/BENCHMARKS.md (memory): the boxed request is most of a tracked stream.
        let size = core::mem::size_of::<Request>();
        eprintln!("size_of::<Request>() = {size}");
        // wasm32: 216 bytes before issue 17, 104 now.
        assert!(
            size <= if cfg!(target_pointer_width = "32") {
                104
            } else {
                136
            },
            "{size}"
        );
    }
}
