//! One request's progress as kvguard-control sees it, without I/O: its clocks (first and
//! last data event, who the response waits on), its data events, and what its body
//! claims. Every method takes the time as an input; the shell keeps one [`Progress`] per
//! request in flight and feeds it what the proxy saw.

use crate::scan::BodyKind;
use kvguard_contract::AbortReason;
use std::time::{Duration, Instant};

/// Progress clocks of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Times {
    /// When its request headers arrived.
    pub started: Instant,
    /// First data event.
    pub first_data: Option<Instant>,
    /// Last data event.
    pub last_data: Option<Instant>,
    /// Stalls of kvguard-control itself while it waited for its first data event
    /// ([`Progress::credit_stall`]): not counted against the first-token timeout.
    pub stalled: Duration,
    /// Who the response body waits on now, once the gateway first asked for it.
    pub flow: Option<Flow>,
    /// How long the response waited on its reader since the last data event (waits that
    /// ended; the current one is in `flow`): none of it is the engine's silence.
    pub drained: Duration,
    /// A kvguard gateway carries it (tagged with its instance): the gateway's silence,
    /// which its stall aborts report, is the drain's evidence, and this replica's own wait
    /// on the reader is none. That wait lags the drain by up to a third of the socket
    /// buffers between (Linux wakes a writer blocked on a full socket only once a third
    /// of it drained; they grow to megabytes), so a steady reader above the floor can
    /// look idle here for minutes.
    pub gateway: bool,
}

impl Times {
    /// How long the engine has been silent at `now`: since the last data event, less
    /// the time the response waited on its reader meanwhile (the engine's frames were
    /// not asked for then). Frames that are no data event (keep-alives) do not end it.
    pub fn engine_silence(&self, now: Instant) -> Option<Duration> {
        let last = self.last_data?;
        let current = self.reader_wait(now).unwrap_or_default();
        Some(
            now.saturating_duration_since(last)
                .saturating_sub(self.drained)
                .saturating_sub(current),
        )
    }

    /// How long the response has been waiting on its reader at `now`, if it is.
    pub fn reader_wait(&self, now: Instant) -> Option<Duration> {
        match self.flow {
            Some(Flow::Reader(t)) => Some(now.saturating_duration_since(t)),
            _ => None,
        }
    }
}

/// Who a response body on its way to the gateway waits on, as kvguard-control sees it:
/// the gateway's connection asks for the next frame ([`Progress::record_demand`]) only once
/// it has room for it, and the engine's frames are read only when asked for. So a silent
/// engine and a client (or hop) that does not read are told apart here, where the
/// engine's side is seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// The gateway asked for a frame at this time and the engine has not sent one since:
    /// the engine's silence counts from here.
    Engine(Instant),
    /// A frame was handed to the gateway's connection at this time and it has not asked
    /// for the next one since (its buffers are full: downstream of here, nobody drained
    /// them): the drain's silence counts from here.
    Reader(Instant),
}

/// What the proxy saw of one request's response so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    started: Instant,
    first_data: Option<Instant>,
    last_data: Option<Instant>,
    stalled: Duration,
    flow: Option<Flow>,
    drained: Duration,
    events: u64,
    kind: Option<BodyKind>,
    status: Option<u16>,
}

impl Progress {
    /// A request whose headers arrived at `started`.
    pub fn new(started: Instant) -> Progress {
        Progress {
            started,
            first_data: None,
            last_data: None,
            stalled: Duration::ZERO,
            flow: None,
            drained: Duration::ZERO,
            events: 0,
            kind: None,
            status: None,
        }
    }

    /// The clocks.
    pub fn times(&self) -> Times {
        Times {
            started: self.started,
            first_data: self.first_data,
            last_data: self.last_data,
            stalled: self.stalled,
            flow: self.flow,
            drained: self.drained,
            gateway: false,
        }
    }

    /// Data events so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The body's kind, once the response head arrived.
    pub fn kind(&self) -> Option<BodyKind> {
        self.kind
    }

    /// The engine's response status, once known.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The gateway's connection asked for the next response frame at `now`: if a frame
    /// was the last thing handed over, the drain progressed (its wait is added to
    /// [`Times::drained`]) and the engine is asked from now ([`Flow::Engine`]); if the
    /// engine was already being asked, nothing changes.
    pub fn record_demand(&mut self, now: Instant) {
        match self.flow {
            Some(Flow::Engine(_)) => {}
            Some(Flow::Reader(t)) => {
                self.drained += now.saturating_duration_since(t);
                self.flow = Some(Flow::Engine(now));
            }
            None => self.flow = Some(Flow::Engine(now)),
        }
    }

    /// A response frame was handed to the gateway's connection at `now`: until it asks
    /// for the next one, the stream waits on its reader ([`Flow::Reader`]).
    pub fn record_handed(&mut self, now: Instant) {
        self.flow = Some(Flow::Reader(now));
    }

    /// A response frame was handed on at `now` ([`Progress::record_handed`]); after it
    /// the engine's body is at its end or not (`body_at_end`, hyper's `is_end_stream`).
    /// Returns whether the request is complete: its body ended and all of it was handed
    /// on. hyper stops polling a body whose length is written once it has all of it, so
    /// for such a body (a non-streaming answer, a prefill leg's) this frame is the only
    /// sign of its end: `Ready(None)`, the other, never comes.
    pub fn record_frame(&mut self, now: Instant, body_at_end: bool) -> bool {
        self.record_handed(now);
        body_at_end
    }

    /// kvguard-control did not run for `stall`, which ended by `now` (the process was
    /// stopped or starved): what the engine sent meanwhile waits in socket buffers, not
    /// yet recorded. The idle clock (last data event) moves on by the stall, at most to
    /// `now`, and so do the first-token clock and the engine's or the drain's
    /// ([`Flow`]): a silence that may have been ours ends nothing. Max age is not moved.
    pub fn credit_stall(&mut self, stall: Duration, now: Instant) {
        match self.last_data.as_mut() {
            Some(last) => *last = (*last + stall).min(now),
            None => self.stalled += stall,
        }
        // The drain and the engine were not watched either.
        self.flow = self.flow.map(|f| match f {
            Flow::Engine(t) => Flow::Engine((t + stall).min(now)),
            Flow::Reader(t) => Flow::Reader((t + stall).min(now)),
        });
    }

    /// Records `n` data events at `now`.
    pub fn record_events(&mut self, n: u64, now: Instant) {
        if n == 0 {
            return;
        }
        self.events += n;
        self.record_progress(now);
    }

    /// Records progress without a countable event at `now`: a frame of a body that is
    /// neither SSE nor NDJSON (a flowing `text/plain` or `application/octet-stream`).
    pub fn record_progress(&mut self, now: Instant) {
        self.first_data.get_or_insert(now);
        self.last_data = Some(now);
        self.drained = Duration::ZERO;
    }

    /// Records the engine's response head at `now`. For a body that is neither SSE nor
    /// NDJSON (a non-streaming JSON answer, an error, a flowing `text/plain`) the head
    /// counts as progress, and so does each of its frames ([`Progress::record_progress`]).
    pub fn record_response(&mut self, status: u16, kind: BodyKind, now: Instant) {
        self.status = Some(status);
        self.kind = Some(kind);
        if kind == BodyKind::Other {
            self.first_data.get_or_insert(now);
            self.last_data = Some(now);
        }
    }

    /// What the request cost as an orphan of a client that went (`gone`), measured at
    /// `closed` (the engine connection closing).
    pub fn orphan_cost(&self, gone: ClientGone, closed: Instant) -> OrphanCost {
        let streaming = matches!(self.kind, Some(BodyKind::Sse | BodyKind::Ndjson));
        OrphanCost {
            reason: gone.reason,
            seconds: closed.saturating_duration_since(gone.at).as_secs_f64(),
            events: streaming.then(|| self.events.saturating_sub(gone.delivered)),
        }
    }
}

/// When the client of a request went away, as the abort's sender reported it
/// (`gone_ms`, `tokens` of the abort body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone {
    /// When it went, on this process's clock.
    pub at: Instant,
    /// Data events the sender had passed to the client.
    pub delivered: u64,
    /// The abort's reason.
    pub reason: AbortReason,
}

/// What an orphan cost: engine time and, for a stream, data events produced after its
/// client had gone ([`Progress::orphan_cost`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OrphanCost {
    /// The abort's reason.
    pub reason: AbortReason,
    /// From the client's departure to the engine connection closing.
    pub seconds: f64,
    /// Data events proxied beyond those the client got; `None` for a body that is not a
    /// stream (a non-streaming answer's tokens are unknowable before it completes).
    pub events: Option<u64>,
}

/// Most sequences one request is counted for (a bound on a body's claim).
pub const MAX_SEQUENCES: u32 = 4096;

/// How many engine sequences an OpenAI-style request body makes the engine run, as vLLM
/// counts them in `num_requests_running` / `num_requests_waiting`: one per choice (`n`)
/// of each prompt (a completion's `prompt` list of strings or of token-id lists is a
/// batch; one string or one token-id list is one prompt). 1 for anything else or a body
/// that is not such JSON; at most [`MAX_SEQUENCES`].
pub fn engine_sequences(body: &[u8]) -> u32 {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return 1;
    };
    let n = v
        .get("n")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(1)
        .max(1);
    let prompts = match v.get("prompt") {
        Some(serde_json::Value::Array(items))
            if !items.is_empty() && items.iter().all(|i| i.is_string() || i.is_array()) =>
        {
            items.len() as u64
        }
        _ => 1,
    };
    u32::try_from(n.saturating_mul(prompts))
        .unwrap_or(MAX_SEQUENCES)
        .min(MAX_SEQUENCES)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_frame_after_which_the_body_is_at_its_end_completes_the_request() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        assert!(
            !p.record_frame(t0 + s(1), false),
            "more of the body to come"
        );
        assert_eq!(p.times().flow, Some(Flow::Reader(t0 + s(1))));
        // A content-length body: its last frame is its end (hyper polls no further).
        assert!(p.record_frame(t0 + s(2), true));
        assert_eq!(p.times().flow, Some(Flow::Reader(t0 + s(2))));
    }

    #[test]
    fn engine_sequences_count_choices_of_each_prompt() {
        assert_eq!(engine_sequences(br#"{"prompt":"a"}"#), 1);
        assert_eq!(engine_sequences(br#"{"prompt":"a","n":4}"#), 4);
        assert_eq!(engine_sequences(br#"{"prompt":["a","b","c"]}"#), 3);
        assert_eq!(engine_sequences(br#"{"prompt":["a","b"],"n":3}"#), 6);
        assert_eq!(engine_sequences(br#"{"prompt":[[1,2],[3]],"n":2}"#), 4);
        // One token-id list is one prompt; a mixed list is not a batch.
        assert_eq!(engine_sequences(br#"{"prompt":[1,2,3]}"#), 1);
        assert_eq!(engine_sequences(br#"{"prompt":["a",1]}"#), 1);
        assert_eq!(engine_sequences(br#"{"prompt":[]}"#), 1);
        assert_eq!(
            engine_sequences(br#"{"messages":[{"role":"user"}],"n":2}"#),
            2
        );
        assert_eq!(engine_sequences(br#"{"n":0}"#), 1);
        assert_eq!(engine_sequences(b"not json"), 1);
        assert_eq!(engine_sequences(br#"{"n":4096}"#), MAX_SEQUENCES);
        assert_eq!(engine_sequences(br#"{"n":4097}"#), MAX_SEQUENCES);
        assert_eq!(engine_sequences(br#"{"n":5000000000}"#), MAX_SEQUENCES);
    }

    #[test]
    fn data_events_move_the_clocks_and_a_head_of_another_body_is_progress() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        assert_eq!((p.kind(), p.status()), (None, None));
        p.record_response(200, BodyKind::Sse, t0);
        assert_eq!((p.kind(), p.status()), (Some(BodyKind::Sse), Some(200)));
        assert_eq!(p.times().first_data, None, "an SSE head is no data event");
        p.record_events(0, t0 + s(1));
        assert_eq!(p.times().first_data, None, "no event, no progress");
        p.record_events(2, t0 + s(1));
        p.record_events(1, t0 + s(3));
        let t = p.times();
        assert_eq!(
            (t.started, t.first_data, t.last_data),
            (t0, Some(t0 + s(1)), Some(t0 + s(3)))
        );
        assert_eq!(p.events(), 3);
        // A body that is neither SSE nor NDJSON: its head and its frames are progress.
        let mut o = Progress::new(t0);
        o.record_response(200, BodyKind::Other, t0 + s(2));
        assert_eq!(o.times().first_data, Some(t0 + s(2)));
        o.record_progress(t0 + s(4));
        let t = o.times();
        assert_eq!(
            (t.first_data, t.last_data),
            (Some(t0 + s(2)), Some(t0 + s(4)))
        );
        assert_eq!(o.events(), 0);
    }

    #[test]
    fn a_stall_moves_the_idle_clock_on_at_most_to_now_and_before_data_the_first_token_clock() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        p.credit_stall(s(3), t0 + s(5));
        assert_eq!(
            p.times().stalled,
            s(3),
            "no data yet: the first-token clock"
        );
        assert_eq!(p.times().last_data, None);
        p.credit_stall(s(1), t0 + s(5));
        assert_eq!(p.times().stalled, s(4), "stalls add up");
        p.record_events(1, t0 + s(6));
        p.credit_stall(s(3), t0 + s(20));
        let t = p.times();
        assert_eq!(t.last_data, Some(t0 + s(9)));
        assert_eq!(
            t.stalled,
            s(4),
            "after the first data event only the idle clock moves"
        );
        p.record_events(1, t0 + s(30));
        p.credit_stall(s(3), t0 + s(31));
        assert_eq!(p.times().last_data, Some(t0 + s(31)), "not past now");
    }

    #[test]
    fn the_flow_says_who_the_response_waits_on_and_a_stall_moves_it() {
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        assert_eq!(p.times().flow, None);
        p.record_demand(t0);
        // Asked again before a frame came: the engine's wait goes on from the first ask.
        p.record_demand(t0 + s(1));
        assert_eq!(p.times().flow, Some(Flow::Engine(t0)));
        assert_eq!(p.times().drained, Duration::ZERO);
        p.record_handed(t0 + s(3));
        assert_eq!(p.times().flow, Some(Flow::Reader(t0 + s(3))));
        p.record_demand(t0 + s(5));
        assert_eq!(p.times().flow, Some(Flow::Engine(t0 + s(5))));
        assert_eq!(p.times().drained, s(2), "the reader's wait, 3 s to 5 s");
        p.credit_stall(s(2), t0 + s(10));
        assert_eq!(p.times().flow, Some(Flow::Engine(t0 + s(7))));
        p.credit_stall(s(9), t0 + s(10));
        assert_eq!(
            p.times().flow,
            Some(Flow::Engine(t0 + s(10))),
            "at most now"
        );
        p.record_handed(t0 + s(10));
        p.credit_stall(s(1), t0 + s(12));
        assert_eq!(p.times().flow, Some(Flow::Reader(t0 + s(11))));
        p.credit_stall(s(5), t0 + s(12));
        assert_eq!(p.times().flow, Some(Flow::Reader(t0 + s(12))));
        // A data event: the reader's past waits no longer count.
        p.record_events(1, t0 + s(13));
        assert_eq!(p.times().drained, Duration::ZERO);
        p.record_handed(t0 + s(13));
        p.record_demand(t0 + s(14));
        assert_eq!(p.times().drained, s(1));
        p.record_progress(t0 + s(15));
        assert_eq!(p.times().drained, Duration::ZERO);
    }

    #[test]
    fn an_orphan_costs_from_its_client_leaving_to_the_close_and_a_stream_counts_events() {
        let t0 = Instant::now();
        let gone = ClientGone {
            at: t0 + s(1),
            delivered: 5,
            reason: AbortReason::DownstreamReset,
        };
        for kind in [BodyKind::Sse, BodyKind::Ndjson] {
            let mut p = Progress::new(t0);
            p.record_response(200, kind, t0);
            p.record_events(12, t0 + s(3));
            let c = p.orphan_cost(gone, t0 + Duration::from_millis(3500));
            assert_eq!(c.seconds, 2.5);
            assert_eq!(c.events, Some(7));
            assert_eq!(c.reason, AbortReason::DownstreamReset);
        }
        let mut n = Progress::new(t0);
        assert_eq!(n.orphan_cost(gone, t0 + s(3)).events, None, "no head yet");
        n.record_response(200, BodyKind::Other, t0);
        assert_eq!(n.orphan_cost(gone, t0 + s(3)).events, None, "not a stream");
    }
}
