//! One tracked request: its clocks, its progress, its completion and its (single)
//! decision; and how Envoy's `response.code_details` / `response.flags` map to an abort
//! reason at the end of a stream.

use crate::config::Limits;
use crate::scan::{Fed, Framing, Scanner};
use kvguard_contract::{AbortReason, RequestId};
use std::net::SocketAddr;

/// What the filter decided for a request; the first decision wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Why.
    pub reason: AbortReason,
    /// Observe mode: counted and logged only.
    pub observed: bool,
}

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

impl From<Decision> for OutcomeTag {
    fn from(d: Decision) -> Self {
        if d.observed {
            OutcomeTag::Observed(d.reason)
        } else {
            OutcomeTag::Aborted(d.reason)
        }
    }
}

/// A tracked request.
#[derive(Debug, Clone)]
pub struct Request {
    /// The abort key.
    pub id: RequestId,
    /// When the request headers arrived (ms, host clock).
    pub start_ms: u64,
    /// The clocks that apply to it.
    pub limits: Limits,
    /// When the last data event arrived.
    pub last_event_ms: Option<u64>,
    /// Data events seen.
    pub events: u64,
    /// The body scanner, once response headers are known.
    pub scanner: Option<Scanner>,
    /// Response headers arrived.
    pub response_started: bool,
    /// The response's end of stream passed the filter.
    pub end_of_stream: bool,
    /// The body said it is complete (`[DONE]`, finish reasons, terminal event, done).
    pub content_complete: bool,
    /// The decision, once made.
    pub decision: Option<Decision>,
    /// The control replica holding it (a verified stamp).
    pub target: Option<SocketAddr>,
}

impl Request {
    /// A request whose headers arrived at `now_ms`.
    pub fn new(id: RequestId, limits: Limits, now_ms: u64) -> Self {
        Request {
            id,
            start_ms: now_ms,
            limits,
            last_event_ms: None,
            events: 0,
            scanner: None,
            response_started: false,
            end_of_stream: false,
            content_complete: false,
            decision: None,
            target: None,
        }
    }

    /// Age at `now_ms`.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.start_ms)
    }

    /// Whether the request is over for the clocks (complete, ended, or decided).
    pub fn settled(&self) -> bool {
        self.content_complete || self.end_of_stream || self.decision.is_some()
    }

    /// Whether the body still needs reading: not complete, not ended, and not decided
    /// for real (an observed decision keeps reading, so that observe mode can tell a
    /// request that would have been aborted but completed later).
    pub fn reading(&self) -> bool {
        let decided = matches!(self.decision, Some(d) if !d.observed);
        !self.content_complete && !self.end_of_stream && !decided
    }

    /// Records the response framing.
    pub fn on_response_headers(&mut self, framing: Framing, max_event_bytes: usize) {
        self.response_started = true;
        self.scanner = Some(Scanner::new(framing, max_event_bytes));
    }

    /// Feeds a body chunk (or, for an opaque body, notes `len` bytes as progress);
    /// returns what the scanner found. Marks content completion.
    pub fn on_body(&mut self, chunk: &[u8], len: usize, end_of_stream: bool, now_ms: u64) -> Fed {
        let mut fed = Fed::default();
        if let Some(s) = self.scanner.as_mut() {
            if s.framing() == Framing::Opaque {
                // Opaque bodies: any bytes are progress, so the clocks do not fire on a
                // stream the filter cannot read (compressed SSE).
                if len > 0 {
                    fed.events = 1;
                }
            } else if !s.completed() {
                fed = s.feed(chunk);
                if end_of_stream {
                    let last = s.finish(&mut |_| {});
                    fed.events += last.events;
                    fed.oversized += last.oversized;
                    fed.malformed += last.malformed;
                    fed.completed |= last.completed;
                }
            }
        }
        if fed.events > 0 {
            self.events += u64::from(fed.events);
            self.last_event_ms = Some(now_ms);
        }
        if fed.completed {
            self.content_complete = true;
        }
        if end_of_stream {
            self.end_of_stream = true;
        }
        fed
    }

    /// The reason a clock fired at `now_ms`, if one did. The earliest deadline wins.
    pub fn due(&self, now_ms: u64) -> Option<AbortReason> {
        if self.settled() {
            return None;
        }
        let mut best: Option<(u64, AbortReason)> = None;
        let mut consider = |deadline: u64, reason: AbortReason| {
            let earlier = match best {
                Some((d, _)) => deadline < d,
                None => true,
            };
            if now_ms >= deadline && earlier {
                best = Some((deadline, reason));
            }
        };
        let l = self.limits;
        if l.max_age_ms > 0 {
            consider(
                self.start_ms.saturating_add(l.max_age_ms),
                AbortReason::MaxAge,
            );
        }
        match self.last_event_ms {
            None if l.first_token_timeout_ms > 0 => consider(
                self.start_ms.saturating_add(l.first_token_timeout_ms),
                AbortReason::FirstTokenTimeout,
            ),
            Some(last) if l.idle_timeout_ms > 0 => {
                consider(last.saturating_add(l.idle_timeout_ms), AbortReason::Stalled)
            }
            _ => {}
        }
        best.map(|(_, r)| r)
    }

    /// Records a decision unless one exists or the request completed; returns whether
    /// it was recorded (one abort per request, first reason wins, completed never).
    pub fn decide(&mut self, reason: AbortReason, observed: bool) -> bool {
        if self.decision.is_some() || self.content_complete {
            return false;
        }
        self.decision = Some(Decision { reason, observed });
        true
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
/// - Any other end of stream (local replies without an upstream, `direct_response`...)
///   → completed; no end of stream at all → `downstream_reset`.
pub fn classify_end(req: &Request, details: &[u8], flag_bits: u64) -> End {
    if req.content_complete {
        return End::Completed;
    }
    if req.end_of_stream && details == b"via_upstream" {
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
    if req.end_of_stream {
        End::Completed
    } else {
        End::Abort(AbortReason::DownstreamReset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(limits: Limits) -> Request {
        Request::new(RequestId::try_new(b"r").unwrap(), limits, 1000)
    }

    const L: Limits = Limits {
        idle_timeout_ms: 100,
        first_token_timeout_ms: 0,
        max_age_ms: 1000,
    };

    #[test]
    fn idle_starts_after_first_event() {
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024);
        assert_eq!(r.due(1900), None); // no event yet, first-token off
        r.on_body(b": keep-alive\n\n", 14, false, 1500);
        assert_eq!(r.due(1990), None); // comments are not progress
        r.on_body(b"data: {}\n\n", 10, false, 1500);
        assert_eq!(r.last_event_ms, Some(1500));
        assert_eq!(r.due(1599), None);
        assert_eq!(r.due(1600), Some(AbortReason::Stalled));
        r.on_body(b"data: x\n\n", 9, false, 1590);
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
        r.on_response_headers(Framing::Sse, 1024);
        r.on_body(b"data: x\n\n", 9, false, 1200);
        assert_eq!(r.due(1299), None);
        assert_eq!(r.due(1300), Some(AbortReason::Stalled));
        let mut r = req(Limits {
            idle_timeout_ms: 0,
            ..L
        });
        r.on_response_headers(Framing::Sse, 1024);
        r.on_body(b"data: x\n\n", 9, false, 1100);
        assert_eq!(r.due(1999), None);
        assert_eq!(r.due(2000), Some(AbortReason::MaxAge));
        // Max age fires even with steady progress.
        r.on_body(b"data: x\n\n", 9, false, 1999);
        assert_eq!(r.due(2000), Some(AbortReason::MaxAge));
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
        assert_eq!(r.decision.unwrap().reason, AbortReason::Stalled);
        assert_eq!(r.due(999_999), None);
        let mut r = req(L);
        r.on_response_headers(Framing::Sse, 1024);
        let fed = r.on_body(b"data: [DONE]\n\n", 14, false, 1001);
        assert!(fed.completed && r.content_complete);
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
        r.on_response_headers(Framing::Opaque, 1024);
        r.on_body(&[], 5, false, 1200);
        assert_eq!(r.last_event_ms, Some(1200));
        assert!(!r.content_complete);
        r.on_body(&[], 0, true, 1300);
        assert!(r.end_of_stream && r.settled());
    }

    #[test]
    fn ndjson_last_line_without_newline_completes() {
        let mut r = req(L);
        r.on_response_headers(Framing::Ndjson, 1024);
        r.on_body(b"{\"done\":false}\n{\"done\":", 0, false, 1100);
        assert!(!r.content_complete);
        r.on_body(b"true}", 0, true, 1200);
        assert!(r.content_complete);
        assert_eq!(r.events, 2);
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
        assert_eq!(
            classify_end(&r, b"", 0),
            End::Abort(AbortReason::DownstreamReset)
        );
        // Envoy's local reply for a route timeout passed the filter with end of stream.
        r.end_of_stream = true;
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
        assert_eq!(classify_end(&r, b"direct_response", 0), End::Completed);
    }

    #[test]
    fn outcome_strings() {
        assert_eq!(OutcomeTag::Completed.as_string(), "completed");
        assert_eq!(OutcomeTag::Untracked.as_string(), "untracked");
        assert_eq!(
            OutcomeTag::from(Decision {
                reason: AbortReason::Stalled,
                observed: false
            })
            .as_string(),
            "aborted:stalled"
        );
        assert_eq!(
            OutcomeTag::from(Decision {
                reason: AbortReason::MaxAge,
                observed: true
            })
            .as_string(),
            "observed:max_age"
        );
    }
}
