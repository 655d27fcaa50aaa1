//! The in-flight table: every proxied request keyed by its request id, with its clocks,
//! its progress and the handles that end it.

use crate::downstream::Downstream;
use crate::scan::BodyKind;
use kvguard_contract::{AbortReason, InstanceId, InstanceTag, RequestId};
pub use kvguard_control_core::request::{
    engine_sequences, ClientGone, Flow, OrphanCost, Progress, Times, MAX_SEQUENCES,
};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;

/// One request in flight.
#[derive(Debug)]
pub struct Entry {
    /// Its id.
    pub id: RequestId,
    /// A number unique to this entry (two requests may share an id over time).
    pub seq: u64,
    /// Method.
    pub method: String,
    /// Path (no query: queries may carry data that does not belong in logs).
    pub path: String,
    /// Unix seconds at start.
    pub started_unix: u64,
    started: Instant,
    progress: Mutex<Progress>,
    ended: Mutex<Option<AbortReason>>,
    observed: AtomicBool,
    sequences: AtomicU32,
    cancel: CancellationToken,
    conn: Mutex<Option<AbortHandle>>,
    finished: CancellationToken,
    downstream: OnceLock<Downstream>,
    client_gone: Mutex<Option<ClientGone>>,
    instance: OnceLock<InstanceTag>,
    pd_leg: OnceLock<kvguard_control_core::pd::PdLeg>,
}

/// The JSON row of `GET /v1/requests`.
#[derive(Debug, Clone, Serialize)]
pub struct EntryView {
    /// Request id.
    pub request_id: String,
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Unix seconds at start.
    pub started_unix: u64,
    /// Age, ms.
    pub age_ms: u64,
    /// Time to first data event, ms.
    pub first_data_ms: Option<u64>,
    /// Since the last data event, ms.
    pub idle_ms: Option<u64>,
    /// Data events (SSE) or lines (NDJSON).
    pub events: u64,
    /// `sse`, `ndjson`, `other`, or null before the response headers.
    pub body: Option<&'static str>,
    /// Engine response status, once known.
    pub status: Option<u16>,
    /// The reason it is being ended, if it is.
    pub ending: Option<AbortReason>,
    /// Who its response waits on now ([`Flow`]): `engine` (asked for its next frame) or
    /// `reader` (the gateway's side has not taken the last one); null before the gateway
    /// first asked.
    pub waiting_on: Option<&'static str>,
    /// For how long, ms.
    pub waiting_ms: Option<u64>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Entry {
    /// A new entry started at `now`.
    pub fn new(
        id: RequestId,
        seq: u64,
        method: String,
        path: String,
        now: Instant,
        now_unix: u64,
    ) -> Entry {
        Entry {
            id,
            seq,
            method,
            path,
            started_unix: now_unix,
            started: now,
            progress: Mutex::new(Progress::new(now)),
            ended: Mutex::new(None),
            observed: AtomicBool::new(false),
            sequences: AtomicU32::new(1),
            cancel: CancellationToken::new(),
            conn: Mutex::new(None),
            finished: CancellationToken::new(),
            downstream: OnceLock::new(),
            client_gone: Mutex::new(None),
            instance: OnceLock::new(),
            pd_leg: OnceLock::new(),
        }
    }

    /// Marks the request as a leg of a disaggregated request (its body carried
    /// `kv_transfer_params`, [`crate::pd::leg_of`]).
    pub fn set_pd_leg(&self, leg: kvguard_control_core::pd::PdLeg) {
        let _ = self.pd_leg.set(leg);
    }

    /// The disaggregation leg its body asked for, if any.
    pub fn pd_leg(&self) -> Option<kvguard_control_core::pd::PdLeg> {
        self.pd_leg.get().copied()
    }

    /// Sets how many engine sequences the request runs (see [`engine_sequences`]).
    pub fn set_sequences(&self, n: u32) {
        self.sequences.store(n.max(1), Ordering::Release);
    }

    /// Engine sequences the request runs: 1 until its body was read.
    pub fn sequences(&self) -> u32 {
        self.sequences.load(Ordering::Acquire)
    }

    /// Records the gateway instance (and worker VM) that carries this request
    /// (`x-kvguard-instance`).
    pub fn set_instance(&self, tag: impl Into<InstanceTag>) {
        let _ = self.instance.set(tag.into());
    }

    /// The gateway instance that carries this request, if tagged.
    pub fn instance(&self) -> Option<InstanceId> {
        self.instance.get().map(|t| t.instance)
    }

    /// The gateway worker VM that carries this request, if its filter names it.
    pub fn vm(&self) -> Option<u32> {
        self.instance.get().and_then(|t| t.vm)
    }

    /// The clocks.
    pub fn times(&self) -> Times {
        Times {
            gateway: self.instance.get().is_some(),
            ..self.progress().times()
        }
    }

    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// See [`Progress::record_demand`].
    pub fn record_demand(&self, now: Instant) {
        self.progress().record_demand(now);
    }

    /// See [`Progress::record_handed`].
    pub fn record_handed(&self, now: Instant) {
        self.progress().record_handed(now);
    }

    /// See [`Progress::record_frame`]: whether the request is complete.
    pub fn record_frame(&self, now: Instant, body_at_end: bool) -> bool {
        self.progress().record_frame(now, body_at_end)
    }

    /// See [`Progress::credit_stall`].
    pub fn credit_stall(&self, stall: Duration, now: Instant) {
        self.progress().credit_stall(stall, now);
    }

    /// Data events so far.
    pub fn events(&self) -> u64 {
        self.progress().events()
    }

    /// See [`Progress::record_events`].
    pub fn record_events(&self, n: u64, now: Instant) {
        self.progress().record_events(n, now);
    }

    /// See [`Progress::record_progress`].
    pub fn record_progress(&self, now: Instant) {
        self.progress().record_progress(now);
    }

    /// See [`Progress::record_response`].
    pub fn record_response(&self, status: u16, kind: BodyKind, now: Instant) {
        self.progress().record_response(status, kind, now);
    }

    /// Marks the request as being ended for `reason`; `false` if it already was (the
    /// first reason wins).
    pub fn mark_ended(&self, reason: AbortReason) -> bool {
        match self.ended.lock() {
            Ok(mut e) if e.is_none() => {
                *e = Some(reason);
                true
            }
            _ => false,
        }
    }

    /// Marks the request as observed (dry run); `false` if it already was.
    pub fn mark_observed(&self) -> bool {
        !self.observed.swap(true, Ordering::AcqRel)
    }

    /// Why it is being ended, if it is.
    pub fn ended(&self) -> Option<AbortReason> {
        self.ended.lock().ok().and_then(|e| *e)
    }

    /// The token cancelled when the request is ended.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Attaches the engine connection's task; if the request was already ended, the
    /// connection is closed at once.
    pub fn set_conn(&self, handle: AbortHandle) {
        if let Ok(mut c) = self.conn.lock() {
            if self.cancel.is_cancelled() {
                handle.abort();
            }
            *c = Some(handle);
        }
    }

    /// Closes the engine-side connection (dropping the TCP socket): vLLM, TGI and
    /// llama.cpp abort the sequence on disconnect.
    pub fn close_engine_conn(&self) {
        if let Ok(c) = self.conn.lock() {
            if let Some(h) = c.as_ref() {
                h.abort();
            }
        }
    }

    /// Attaches the downstream task the request runs in (once).
    pub fn set_downstream(&self, d: Downstream) {
        let _ = self.downstream.set(d);
    }

    /// The downstream task the request runs in, if known.
    pub fn downstream(&self) -> Option<&Downstream> {
        self.downstream.get()
    }

    /// Marks the response as gone (finished, or dropped by hyper).
    pub fn finish(&self) {
        self.finished.cancel();
    }

    /// Cancelled once the response is gone.
    pub fn finished_token(&self) -> &CancellationToken {
        &self.finished
    }

    /// Ends it: cancels the token (the proxy sends the SSE event and ends the stream) and
    /// closes the engine connection.
    pub fn end(&self) {
        self.cancel.cancel();
        self.close_engine_conn();
    }

    /// Records that its client went away (first report wins).
    pub fn mark_client_gone(&self, gone: ClientGone) {
        if let Ok(mut g) = self.client_gone.lock() {
            g.get_or_insert(gone);
        }
    }

    /// The orphan's cost if its client is known to have gone, measured at `closed` (the
    /// engine connection closing); once: later calls return `None`.
    pub fn take_orphan_cost(&self, closed: Instant) -> Option<OrphanCost> {
        let gone = self.client_gone.lock().ok()?.take()?;
        Some(self.progress().orphan_cost(gone, closed))
    }

    /// The JSON view at `now`.
    pub fn view(&self, now: Instant) -> EntryView {
        let (t, events, kind, status) = {
            let p = self.progress();
            (p.times(), p.events(), p.kind(), p.status())
        };
        let (first, last, flow) = (t.first_data, t.last_data, t.flow);
        let (waiting_on, since) = match flow {
            Some(Flow::Engine(t)) => (Some("engine"), Some(t)),
            Some(Flow::Reader(t)) => (Some("reader"), Some(t)),
            None => (None, None),
        };
        EntryView {
            request_id: self.id.as_str().to_owned(),
            method: self.method.clone(),
            path: self.path.clone(),
            started_unix: self.started_unix,
            age_ms: ms(now.saturating_duration_since(self.started)),
            first_data_ms: first.map(|f| ms(f.saturating_duration_since(self.started))),
            idle_ms: last.map(|l| ms(now.saturating_duration_since(l))),
            events,
            body: kind.map(|k| match k {
                BodyKind::Sse => "sse",
                BodyKind::Ndjson => "ndjson",
                BodyKind::Other => "other",
            }),
            status,
            ending: self.ended(),
            waiting_on,
            waiting_ms: since.map(|t| ms(now.saturating_duration_since(t))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streaming completion `r` (sequence 1) admitted at `t0`.
    fn completion(t0: Instant) -> Entry {
        Entry::new(
            RequestId::try_new(b"r").unwrap(),
            1,
            "POST".into(),
            "/v1/completions".into(),
            t0,
            100,
        )
    }

    #[test]
    fn engine_sequences_count_choices_of_each_prompt() {
        assert_eq!(engine_sequences(br#"{"prompt":"a"}"#), 1);
        assert_eq!(engine_sequences(br#"{"prompt":"a","n":4}"#), 4);
        assert_eq!(engine_sequences(br#"{"prompt":["a","b","c"]}"#), 3);
        assert_eq!(engine_sequences(br#"{"prompt":["a","b"],"n":3}"#), 6);
        assert_eq!(engine_sequences(br#"{"prompt":[[1,2],[3]],"n":2}"#), 4);
        // One token-id list is one prompt.
        assert_eq!(engine_sequences(br#"{"prompt":[1,2,3]}"#), 1);
        assert_eq!(engine_sequences(br#"{"prompt":[]}"#), 1);
        assert_eq!(
            engine_sequences(br#"{"messages":[{"role":"user"}],"n":2}"#),
            2
        );
        assert_eq!(engine_sequences(br#"{"n":0}"#), 1);
        assert_eq!(engine_sequences(b"not json"), 1);
        assert_eq!(engine_sequences(br#"{"n":1000000}"#), MAX_SEQUENCES);
        assert_eq!(engine_sequences(br#"{"n":5000000000}"#), MAX_SEQUENCES);
        let e = completion(Instant::now());
        assert_eq!(e.sequences(), 1);
        e.set_sequences(4);
        assert_eq!(e.sequences(), 4);
        e.set_sequences(0);
        assert_eq!(e.sequences(), 1);
    }

    #[test]
    fn a_request_a_gateway_tagged_is_judged_by_the_gateways_silence_not_the_wait_here() {
        let e = completion(Instant::now());
        assert!(!e.times().gateway);
        e.set_instance(InstanceTag {
            instance: InstanceId([7; 16]),
            vm: Some(2),
        });
        assert!(e.times().gateway);
        assert_eq!((e.instance(), e.vm()), (Some(InstanceId([7; 16])), Some(2)));
    }

    #[test]
    fn first_reason_wins_and_progress() {
        let t0 = Instant::now();
        let e = completion(t0);
        assert!(e.mark_ended(AbortReason::Stalled));
        assert!(!e.mark_ended(AbortReason::MaxAge));
        assert_eq!(e.ended(), Some(AbortReason::Stalled));
        e.record_response(200, BodyKind::Sse, t0);
        assert_eq!(e.times().first_data, None);
        e.record_events(2, t0 + Duration::from_secs(1));
        e.record_events(1, t0 + Duration::from_secs(3));
        let t = e.times();
        assert_eq!(t.first_data, Some(t0 + Duration::from_secs(1)));
        assert_eq!(t.last_data, Some(t0 + Duration::from_secs(3)));
        let v = e.view(t0 + Duration::from_secs(4));
        assert_eq!(v.events, 3);
        assert_eq!(v.age_ms, 4000);
        assert_eq!(v.idle_ms, Some(1000));
        assert_eq!(v.first_data_ms, Some(1000));
        assert!(e.mark_observed());
        assert!(!e.mark_observed());
    }

    #[test]
    fn a_stall_moves_the_idle_clock_on_at_most_to_now_and_before_data_the_first_token_clock() {
        let t0 = Instant::now();
        let e = completion(t0);
        let s = Duration::from_secs(3);
        e.credit_stall(s, t0 + Duration::from_secs(5));
        assert_eq!(e.times().stalled, s, "no data yet: the first-token clock");
        assert_eq!(e.times().last_data, None);
        e.record_events(1, t0 + Duration::from_secs(6));
        e.credit_stall(s, t0 + Duration::from_secs(20));
        let t = e.times();
        assert_eq!(t.last_data, Some(t0 + Duration::from_secs(9)));
        assert_eq!(
            t.stalled, s,
            "after the first data event only the idle clock moves"
        );
        // Data recorded after the stall (at `now`) is not moved past `now`.
        e.record_events(1, t0 + Duration::from_secs(30));
        e.credit_stall(s, t0 + Duration::from_secs(31));
        assert_eq!(e.times().last_data, Some(t0 + Duration::from_secs(31)));
        e.credit_stall(Duration::from_secs(100), t0 + Duration::from_secs(32));
        assert_eq!(e.times().last_data, Some(t0 + Duration::from_secs(32)));
    }

    #[test]
    fn the_flow_says_who_the_response_waits_on_and_a_stall_moves_it() {
        let t0 = Instant::now();
        let e = completion(t0);
        let s = Duration::from_secs;
        assert_eq!(e.times().flow, None);
        assert_eq!(e.view(t0).waiting_on, None);
        e.record_demand(t0);
        // Asked again before a frame came: the engine's wait goes on from the first ask.
        e.record_demand(t0 + s(1));
        assert_eq!(e.times().flow, Some(Flow::Engine(t0)));
        let v = e.view(t0 + s(2));
        assert_eq!((v.waiting_on, v.waiting_ms), (Some("engine"), Some(2000)));
        e.record_handed(t0 + s(3));
        assert_eq!(e.times().flow, Some(Flow::Reader(t0 + s(3))));
        assert_eq!(e.view(t0 + s(4)).waiting_on, Some("reader"));
        e.record_demand(t0 + s(5));
        assert_eq!(e.times().flow, Some(Flow::Engine(t0 + s(5))));
        assert_eq!(e.times().drained, s(2), "the reader's wait, 3 s to 5 s");
        // A stall of kvguard-control moves it on, at most to now.
        e.credit_stall(s(2), t0 + s(10));
        assert_eq!(e.times().flow, Some(Flow::Engine(t0 + s(7))));
        e.record_handed(t0 + s(10));
        e.credit_stall(s(5), t0 + s(12));
        assert_eq!(e.times().flow, Some(Flow::Reader(t0 + s(12))));
        // A data event: the reader's past waits no longer count.
        e.record_events(1, t0 + s(13));
        assert_eq!(e.times().drained, Duration::ZERO);
        e.record_handed(t0 + s(13));
        e.record_demand(t0 + s(14));
        assert_eq!(e.times().drained, s(1));
        e.record_progress(t0 + s(15));
        assert_eq!(e.times().drained, Duration::ZERO);
    }

    #[test]
    fn a_frame_completes_the_request_when_its_body_is_at_its_end_after_it() {
        let t0 = Instant::now();
        let e = completion(t0);
        let s = Duration::from_secs;
        assert!(!e.record_frame(t0 + s(1), false));
        assert_eq!(e.times().flow, Some(Flow::Reader(t0 + s(1))));
        assert!(e.record_frame(t0 + s(2), true));
        assert_eq!(e.times().flow, Some(Flow::Reader(t0 + s(2))));
    }

    #[test]
    fn events_are_counted_and_a_frame_of_another_body_is_progress_without_an_event() {
        let t0 = Instant::now();
        let e = completion(t0);
        assert_eq!(e.events(), 0);
        e.record_events(2, t0 + Duration::from_secs(1));
        e.record_events(3, t0 + Duration::from_secs(2));
        assert_eq!(e.events(), 5);
        let plain = Entry::new(
            RequestId::try_new(b"p").unwrap(),
            2,
            "GET".into(),
            "/".into(),
            t0,
            100,
        );
        plain.record_progress(t0 + Duration::from_secs(1));
        plain.record_progress(t0 + Duration::from_secs(4));
        let t = plain.times();
        assert_eq!(t.first_data, Some(t0 + Duration::from_secs(1)));
        assert_eq!(t.last_data, Some(t0 + Duration::from_secs(4)));
        assert_eq!(plain.events(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn ending_closes_the_engine_connection_even_one_attached_after_the_end() {
        let e = completion(Instant::now());
        let closed = |task: tokio::task::JoinHandle<()>| async move {
            tokio::time::timeout(Duration::from_secs(1), task)
                .await
                .is_ok_and(|r| r.is_err_and(|e| e.is_cancelled()))
        };
        let conn = tokio::spawn(std::future::pending::<()>());
        e.set_conn(conn.abort_handle());
        tokio::task::yield_now().await;
        assert!(
            !conn.is_finished(),
            "a request not ended keeps its connection"
        );
        e.end();
        assert!(closed(conn).await);
        let late = tokio::spawn(std::future::pending::<()>());
        e.set_conn(late.abort_handle());
        assert!(closed(late).await, "attached after the end: closed at once");
    }

    #[test]
    fn orphan_cost_from_the_client_leaving_to_the_close_once() {
        let t0 = Instant::now();
        let e = completion(t0);
        assert_eq!(e.take_orphan_cost(t0), None);
        e.record_response(200, BodyKind::Sse, t0);
        e.record_events(5, t0 + Duration::from_secs(1));
        e.mark_client_gone(ClientGone {
            at: t0 + Duration::from_secs(1),
            delivered: 5,
            reason: AbortReason::DownstreamReset,
        });
        // A later report does not move the departure.
        e.mark_client_gone(ClientGone {
            at: t0 + Duration::from_secs(2),
            delivered: 6,
            reason: AbortReason::Stalled,
        });
        e.record_events(7, t0 + Duration::from_secs(3));
        let c = e
            .take_orphan_cost(t0 + Duration::from_millis(3500))
            .unwrap();
        assert_eq!(c.seconds, 2.5);
        assert_eq!(c.events, Some(7));
        assert_eq!(c.reason, AbortReason::DownstreamReset);
        assert_eq!(e.take_orphan_cost(t0 + Duration::from_secs(9)), None);

        // Not a stream: time only.
        let n = Entry::new(
            RequestId::try_new(b"n").unwrap(),
            2,
            "POST".into(),
            "/v1/completions".into(),
            t0,
            100,
        );
        n.mark_client_gone(ClientGone {
            at: t0,
            delivered: 0,
            reason: AbortReason::DownstreamReset,
        });
        let c = n.take_orphan_cost(t0 + Duration::from_secs(2)).unwrap();
        assert_eq!((c.seconds, c.events), (2.0, None));
    }
}
