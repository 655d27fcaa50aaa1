//! The per-VM brain: the request table (one per worker, no locking), decisions, the
//! abort queue and the tick. The glue calls it from the proxy-wasm callbacks; it never
//! calls back into a stream (closing streams and writing filter state are returned as
//! [`Action`]s for the glue to perform with no borrow held).

use crate::aborts::{AbortQueue, Finished, Job};
use crate::config::{Config, Mode};
use crate::cut::{cut_allowed, Valve};
use crate::host::{Level, Platform};
use crate::metrics::{Anomaly, Ended, Metric, Outcome, StampRejected, Untracked};
use crate::request::{classify_end, End, OutcomeTag, Request};
use crate::scan::Framing;
use crate::tracked_id::TrackedId;
use kvguard_contract::{stamp, AbortReason};

/// Most requests tracked per VM; beyond, requests are not tracked (fail open).
pub const MAX_TRACKED: usize = 100_000;

/// What the filter makes of a request's headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The path is not tracked.
    NotMatching,
    /// The path is tracked but the request cannot be (no / bad id, table full).
    Untracked(Option<Untracked>),
    /// Tracked.
    Tracked,
}

/// What the glue must read of the response body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyNeed {
    /// Nothing: untracked, complete or decided.
    Nothing,
    /// Only the chunk length and end of stream (opaque body).
    Length,
    /// The bytes (SSE / NDJSON).
    Bytes,
}

/// Something the glue must do on a stream after a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Write the outcome to the stream's filter state, then close the stream.
    Close {
        /// Stream context id.
        ctx: u32,
        /// Its outcome.
        tag: OutcomeTag,
    },
    /// Observe mode: write the outcome to the stream's filter state only.
    Mark {
        /// Stream context id.
        ctx: u32,
        /// Its outcome.
        tag: OutcomeTag,
    },
}

/// What applying [`Action`]s did (for the metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Streams closed.
    pub closed: i64,
    /// Host calls that failed (the stream was left alone).
    pub failed: i64,
}

/// The host's stream operations that [`apply`] needs (the glue: effective context,
/// filter state, `proxy_close_stream`).
pub trait Streams {
    /// Makes `ctx` the effective context; false if the host refused.
    fn select(&mut self, ctx: u32) -> bool;
    /// Writes the outcome to the selected stream's filter state.
    fn set_outcome(&mut self, tag: OutcomeTag);
    /// Closes the selected stream (may run its `on_log` at once); false if refused.
    fn close(&mut self) -> bool;
    /// Makes the root context effective again.
    fn restore(&mut self);
}

/// Performs the tick's actions on their streams, with no engine borrow held (closing a
/// stream can run its `on_log`, which needs the engine).
pub fn apply<S: Streams + ?Sized>(actions: &[Action], s: &mut S) -> Applied {
    let mut done = Applied::default();
    for a in actions {
        let (ctx, tag, close) = match *a {
            Action::Close { ctx, tag } => (ctx, tag, true),
            Action::Mark { ctx, tag } => (ctx, tag, false),
        };
        if !s.select(ctx) {
            done.failed += 1;
            continue;
        }
        s.set_outcome(tag);
        if close {
            if s.close() {
                done.closed += 1;
            } else {
                done.failed += 1;
            }
        }
    }
    if !actions.is_empty() {
        s.restore();
    }
    done
}

/// Settles an end that nothing named ([`End::Unnamed`]): a local reply (Envoy's or another
/// filter's: ext_proc's `immediate_response`, `response_payload_too_large`, a filter's
/// `send_http_response`, each of which ends the client's stream with no word from the
/// upstream) or a route's `direct_response`. Returns the abort reason, `None` for a
/// completion.
///
/// - The request reached an upstream (one property read, only here): the engine may
///   still be generating for it, so abort (`local_reply`). If the upstream had in fact
///   finished (a filter replaced a complete response), the abort costs a 404.
/// - It did not (a filter or the router answered before any upstream, a
///   `direct_response`): nothing runs for it. An end of stream completed it; without one
///   the client's stream went away (`downstream_reset`, as before).
fn settle_unnamed<P: Platform + ?Sized>(p: &mut P, ended: bool) -> Option<AbortReason> {
    if p.upstream_reached() {
        Some(AbortReason::LocalReply)
    } else if ended {
        None
    } else {
        Some(AbortReason::DownstreamReset)
    }
}

/// The per-request histograms, recorded once at the request's end (three host calls per
/// request at most), labelled by how it ended: time to the first data event, the largest
/// gap between data events (streams of two events or more), and the duration.
fn record_request_histograms<P: Platform + ?Sized>(p: &mut P, req: &Request, now: u64) {
    let ended = match req.outcome() {
        Some(OutcomeTag::Aborted(_)) => Ended::Aborted,
        Some(OutcomeTag::Observed(_)) => Ended::Observed,
        _ => Ended::Completed,
    };
    if let Some(first) = req.first_token_ms() {
        p.record(Metric::FirstTokenMs(ended), first);
    }
    if req.events() >= 2 {
        p.record(Metric::MaxTokenGapMs(ended), req.max_gap_ms());
    }
    p.record(Metric::StreamDurationMs(ended), req.age_ms(now));
}

/// How long the worker did not run, seen by a host tick `gap` ms after the previous one
/// with period `tick`: the lateness beyond one period once the tick came more than two
/// periods apart (a loaded event loop is late by less), else 0. Counted and logged only:
/// no decision depends on how late ticks come ([`crate::cut`]).
pub fn worker_stall(gap: u64, tick: u64) -> u64 {
    if gap > tick.saturating_mul(2) {
        gap - tick
    } else {
        0
    }
}

/// The per-VM state.
#[derive(Debug)]
pub struct Engine {
    /// The configuration.
    pub cfg: Config,
    /// Enforce or observe, as the host says now (the kill switch; starts as `cfg.mode`).
    mode: Mode,
    /// The mass-stall valve ([`crate::cut`]).
    valve: Valve,
    /// Boxed: the table's slots stay small (its capacity grows in powers of two, so
    /// unboxed requests would cost up to twice their size per tracked stream).
    table: crate::Map<u32, Box<Request>>,
    queue: AbortQueue,
    /// The tick period the host was asked for (ms, 0 = off).
    tick_period: u64,
    /// The period before the last change (restored when the host refuses a change).
    tick_before: u64,
    /// The host needs the tick even with nothing tracked (lease renewals).
    keep_ticking: bool,
    memory_reported: u64,
    finished: Vec<Finished>,
    /// When the host's previous tick came (ms; `None` until one has since the tick
    /// started), for the worker-stall count.
    last_host_tick: Option<u64>,
}

/// The tracked request of stream `ctx` in `table`, to change: one copy of the table's
/// lookup for the calls off the per-chunk path (the module is size-bound).
#[inline(never)]
fn request_mut(table: &mut crate::Map<u32, Box<Request>>, ctx: u32) -> Option<&mut Request> {
    table.get_mut(&ctx).map(|r| &mut **r)
}

/// At the upstream's end of stream (enforce mode): whether it is held for the next tick
/// to cut the stream ([`Request::end_held`]), as `Aborted(stalled)`. Without this,
/// kvguard-control's end of a stream it does not defer would reach a client that reads
/// nothing, and Envoy would keep its connection with the end undrained.
#[inline(never)]
fn end_held(mode: Mode, req: &mut Request) -> Option<OutcomeTag> {
    (mode == Mode::Enforce && req.end_held()).then_some(OutcomeTag::Aborted(AbortReason::Stalled))
}

/// How a decision came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// A clock fired at a tick.
    Tick,
    /// The stream already ended (`on_log`): the abort's `gone_ms` counts from the decision.
    ClientGone,
    /// A stall of this stream put to kvguard-control first ([`crate::cut`], enforce mode).
    Ask(u32),
    /// kvguard-control answered that stall with no deferral: its abort is sent already.
    Answered,
}

/// Decides `reason` for `req` at `now_ms` and queues its abort (enforce mode). Asked
/// ([`Via::Ask`]): nothing is decided yet; the abort allows a deferral and the stream
/// stays open until its first answer ([`Engine::report_finished`]): `None`, unless the
/// queue has no room (then it is cut now, as without kvguard-control).
#[allow(clippy::too_many_arguments)]
fn decide<P: Platform + ?Sized>(
    mode: Mode,
    queue: &mut AbortQueue,
    p: &mut P,
    req: &mut Request,
    reason: AbortReason,
    now_ms: u64,
    via: Via,
    finished: &mut Vec<Finished>,
) -> Option<OutcomeTag> {
    let observe = mode == Mode::Observe;
    let ask = match via {
        Via::Ask(ctx) => Some((ctx, req.idle_window())),
        _ => None,
    };
    if ask.is_some() {
        req.ask();
    } else if !req.decide(reason, observe) {
        return None;
    }
    // Progress counted since the last tick gets its time (no earlier than the truth).
    req.stamp(now_ms);
    let age = req.age_ms(now_ms);
    if observe {
        p.add(Metric::WouldAbort(reason), 1);
        p.log(
            Level::Info,
            &format!(
                "would abort request_id={} reason={} age_ms={age} events={} (observe mode)",
                req.id,
                reason.as_str(),
                req.events()
            ),
        );
        return Some(OutcomeTag::Observed(reason));
    }
    if via == Via::Answered {
        return Some(OutcomeTag::Aborted(reason));
    }
    let target = req.target.as_deref().copied();
    let gone = (via == Via::ClientGone).then_some(now_ms);
    let mut job = Job::new(
        req.id.to_request_id(),
        reason,
        age,
        req.events(),
        target,
        now_ms,
    )
    .with_times(req.last_event_ms(), gone);
    job.ask = ask;
    if let Err(job) = queue.push(job, p) {
        p.add(Metric::Aborts(reason, Outcome::Dropped), 1);
        finished.push(Finished {
            job: *job,
            outcome: Outcome::Dropped,
            status: None,
        });
        if ask.is_some() {
            req.answered(false, now_ms);
            req.decide(reason, false);
            return Some(OutcomeTag::Aborted(reason));
        }
    }
    ask.is_none().then_some(OutcomeTag::Aborted(reason))
}

impl Engine {
    /// A new engine; `seed` drives retry jitter.
    pub fn new(cfg: Config, seed: u64) -> Self {
        let queue = AbortQueue::new(cfg.max_pending_aborts, seed);
        Engine {
            mode: cfg.mode,
            cfg,
            valve: Valve::default(),
            table: crate::Map::default(),
            queue,
            tick_period: 0,
            tick_before: 0,
            keep_ticking: false,
            memory_reported: 0,
            finished: Vec::new(),
            last_host_tick: None,
        }
    }

    /// Applies a new configuration (a plugin reconfigured in place): tracked requests
    /// keep the clocks they started with; new ones use the new configuration; a changed
    /// `tick_ms` is re-armed by the next [`Engine::tick_change`].
    pub fn reconfigure<P: Platform + ?Sized>(&mut self, p: &mut P, cfg: Config) {
        self.queue.set_max_pending(cfg.max_pending_aborts);
        let mode = cfg.mode;
        self.cfg = cfg;
        // The period may have changed: the next tick measures no gap.
        self.last_host_tick = None;
        self.set_mode(p, mode);
    }

    /// The mode decisions use now.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The kill switch: every later decision (tick and `on_log`) uses `mode`, also for
    /// streams already in flight. Back to enforce, what observe mode flagged starts its
    /// clocks afresh instead of being closed at once.
    pub fn set_mode<P: Platform + ?Sized>(&mut self, p: &mut P, mode: Mode) {
        if mode == self.mode {
            return;
        }
        self.mode = mode;
        p.log(
            Level::Info,
            &format!(
                "mode is now {} for the {} streams in flight and new ones",
                mode.as_str(),
                self.table.len()
            ),
        );
        if mode == Mode::Enforce {
            let now = p.now_ms();
            for req in self.table.values_mut() {
                req.restart_clocks(now);
            }
        }
    }

    /// Requests tracked now.
    pub fn tracked(&self) -> usize {
        self.table.len()
    }

    /// Aborts queued, backing off or in flight.
    pub fn pending_aborts(&self) -> usize {
        self.queue.pending()
    }

    /// The tracked request of a stream.
    pub fn request(&self, ctx: u32) -> Option<&Request> {
        self.table.get(&ctx).map(|r| &**r)
    }

    /// The kvguard-control replicas holding this VM's streams in flight (each once, at
    /// most [`crate::lease::MAX_REPLICAS`]): the lease renews every one of them.
    pub fn targets(&self) -> Vec<core::net::SocketAddr> {
        let mut v: Vec<core::net::SocketAddr> = Vec::new();
        for t in self.table.values().filter_map(|r| r.target.as_deref()) {
            if !v.contains(t) {
                v.push(*t);
                if v.len() >= crate::lease::MAX_REPLICAS {
                    break;
                }
            }
        }
        v
    }

    /// Request headers: decides whether to track.
    pub fn on_request_headers<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        ctx: u32,
        path: Option<&[u8]>,
        request_id: Option<&[u8]>,
        body_follows: bool,
    ) -> Verdict {
        let Some(limits) = path.and_then(|path| self.cfg.limits_for(path)) else {
            return Verdict::NotMatching;
        };
        let id = match request_id.map(TrackedId::try_new) {
            None => {
                p.add(Metric::RequestsUntracked(Untracked::NoRequestId), 1);
                return Verdict::Untracked(Some(Untracked::NoRequestId));
            }
            Some(Err(e)) => {
                p.add(Metric::RequestsUntracked(Untracked::BadRequestId), 1);
                if p.log_enabled(Level::Debug) {
                    p.log(Level::Debug, &format!("request not tracked: {e}"));
                }
                return Verdict::Untracked(Some(Untracked::BadRequestId));
            }
            Some(Ok(id)) => id,
        };
        if self.table.len() >= MAX_TRACKED {
            p.add(Metric::HostErrors, 1);
            p.log(
                Level::Warn,
                &format!("{MAX_TRACKED} requests tracked on this worker; not tracking {id}"),
            );
            return Verdict::Untracked(None);
        }
        let mut req = Box::new(Request::new(id, limits, p.now_exact()));
        if body_follows {
            req.on_request_body_follows();
        }
        if let Some(old) = self.table.insert(ctx, req) {
            // A context id reused without on_log: drop the stale entry.
            p.log(
                Level::Warn,
                &format!("context {ctx} reused; dropping stale request {}", old.id),
            );
            p.add(Metric::ActiveRequests, -1);
        }
        p.add(Metric::RequestsTracked, 1);
        p.add(Metric::ActiveRequests, 1);
        Verdict::Tracked
    }

    /// Response headers: picks the body framing, checks the control stamp.
    pub fn on_response_headers<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        ctx: u32,
        content_type: Option<&[u8]>,
        content_encoding: Option<&[u8]>,
        stamp_value: Option<&[u8]>,
        end_of_stream: bool,
    ) -> BodyNeed {
        let max_event_bytes = self.cfg.max_event_bytes;
        let Some(req) = request_mut(&mut self.table, ctx) else {
            return BodyNeed::Nothing;
        };
        let (framing, compressed) = Framing::of(content_type, content_encoding);
        if compressed {
            p.add(Metric::ParseAnomalies(Anomaly::Compressed), 1);
        } else if framing == Framing::Opaque && !end_of_stream {
            p.add(Metric::ParseAnomalies(Anomaly::OpaqueBody), 1);
        }
        req.on_response_headers(framing, max_event_bytes, end_of_stream);
        if let (Some(target), Some(value)) = (self.cfg.target.as_ref(), stamp_value) {
            match stamp::verify(&self.cfg.stamp_keys, value, &req.id.to_request_id()) {
                Ok(s) if !target.cidrs.iter().any(|c| c.contains(s.addr.ip())) => {
                    p.add(Metric::StampRejected(StampRejected::OutsideCidrs), 1);
                    p.log(
                        Level::Warn,
                        &format!(
                            "x-kvguard-control address {} is outside control_target_cidrs (request_id={})",
                            s.addr, req.id
                        ),
                    );
                }
                Ok(s) if !target.ports.contains(&s.addr.port()) => {
                    p.add(Metric::StampRejected(StampRejected::PortNotAllowed), 1);
                    p.log(
                        Level::Warn,
                        &format!(
                            "x-kvguard-control address {} names a port outside control_target_ports (request_id={})",
                            s.addr, req.id
                        ),
                    );
                }
                Ok(s) => req.target = Some(Box::new(s.addr)),
                Err(e) => {
                    let cause = match e {
                        stamp::StampError::Malformed => StampRejected::Malformed,
                        stamp::StampError::Mismatch => StampRejected::Mismatch,
                        stamp::StampError::Outdated => StampRejected::Outdated,
                    };
                    p.add(Metric::StampRejected(cause), 1);
                    p.log(Level::Warn, &format!("{e} (request_id={})", req.id));
                }
            }
        }
        Self::need(req)
    }

    fn need(req: &Request) -> BodyNeed {
        match req.reading() {
            None => BodyNeed::Nothing,
            Some(Framing::Opaque) => BodyNeed::Length,
            Some(_) => BodyNeed::Bytes,
        }
    }

    /// What the glue must read of the next body chunk of a stream.
    pub fn body_need(&self, ctx: u32) -> BodyNeed {
        self.table
            .get(&ctx)
            .map_or(BodyNeed::Nothing, |r| Self::need(r))
    }

    /// A response body chunk, with one table lookup: `read` is asked for the chunk's
    /// bytes only when the body is scanned ([`BodyNeed::Bytes`]); `None` from it is an
    /// unreadable chunk (progress and a host error, never a stall). No clock is read
    /// unless the request asks for one (its first progress, or the first after a quiet
    /// tick; see [`Request`]). Returns `Completed` when the body completed the response
    /// just now; `Aborted(stalled)` when the glue must hold this last chunk (not pass the
    /// end on): a stall of the stream was put to kvguard-control and not deferred, and
    /// the next tick cuts it ([`end_held`]). The one body path: the glue and the
    /// tests both come through here.
    pub fn on_chunk<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        ctx: u32,
        len: usize,
        end_of_stream: bool,
        read: impl FnOnce() -> Option<Vec<u8>>,
    ) -> Option<OutcomeTag> {
        let req = self.table.get_mut(&ctx)?;
        let chunk = match Self::need(req) {
            BodyNeed::Bytes if len > 0 => match read() {
                Some(b) => b,
                None => {
                    p.add(Metric::HostErrors, 1);
                    if req.on_unreadable_body(end_of_stream) {
                        Self::mark(p, req);
                    }
                    return end_held(self.mode, req);
                }
            },
            _ => Vec::new(),
        };
        let (fed, clock) = req.on_body(&chunk, len, end_of_stream, &self.cfg.event_words);
        if clock {
            Self::mark(p, req);
        }
        if fed.oversized > 0 {
            p.add(
                Metric::ParseAnomalies(Anomaly::OversizedEvent),
                i64::from(fed.oversized),
            );
        }
        if fed.malformed > 0 {
            p.add(
                Metric::ParseAnomalies(Anomaly::MalformedJson),
                i64::from(fed.malformed),
            );
        }
        if !fed.completed {
            return end_held(self.mode, req);
        }
        // Observe mode: the outcome stays `observed:<reason>`.
        req.observed.is_none().then_some(OutcomeTag::Completed)
    }

    /// The exact time of the progress just counted; when the clock cannot be read, the
    /// next tick stamps it (later than the truth, never earlier).
    fn mark<P: Platform + ?Sized>(p: &mut P, req: &mut Request) {
        if let Some(now) = p.now_exact() {
            req.mark(now);
        }
    }

    /// The request body ended (its last chunk or its trailers): the first-token clock
    /// counts from now. Reads the clock only when that clock is on for the request.
    pub fn on_request_end<P: Platform + ?Sized>(&mut self, p: &mut P, ctx: u32) {
        if let Some(req) = request_mut(&mut self.table, ctx) {
            if req.waits_for_upload() {
                req.on_request_end(p.now_exact());
            }
        }
    }

    /// The response trailers passed: the upstream ended the response. Returns whether
    /// the glue must hold them ([`Engine::on_chunk`]'s `Aborted`).
    pub fn on_response_trailers(&mut self, ctx: u32) -> bool {
        request_mut(&mut self.table, ctx).is_some_and(|req| {
            req.on_trailers();
            end_held(self.mode, req).is_some()
        })
    }

    /// Whether [`Engine::on_log`] needs Envoy's `response.code_details` and
    /// `response.flags` for this stream: not when the body already said it was complete
    /// or an abort was already decided (then the two property reads, host calls that
    /// serialise stream info, are skipped for the common healthy stream).
    pub fn end_details_needed(&self, ctx: u32) -> bool {
        self.table.get(&ctx).is_some_and(|req| req.end_matters())
    }

    /// The stream ended (access-log time): settles the request. Returns its outcome when
    /// it still has to be written to filter state: `None` when the request was not
    /// tracked, or when its body already said it was complete ([`Engine::on_response_body`]
    /// returned `completed` then, and the value is already there).
    pub fn on_log<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        ctx: u32,
        details: &[u8],
        flags: u64,
    ) -> Option<OutcomeTag> {
        let mut req = self.table.remove(&ctx)?;
        p.add(Metric::ActiveRequests, -1);
        let now = p.now_ms();
        let tag = self.settle(p, &mut req, details, flags, now);
        // After the classification: the histograms are labelled by how it ended.
        record_request_histograms(p, &req, now);
        tag
    }

    /// `on_log`'s classification of a request taken out of the table.
    fn settle<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        req: &mut Request,
        details: &[u8],
        flags: u64,
        now: u64,
    ) -> Option<OutcomeTag> {
        if req.aborted().is_some() {
            return req.outcome();
        }
        let early = match classify_end(req, details, flags) {
            End::Completed => None,
            End::Abort(reason) => Some(reason),
            End::Unnamed { ended } => settle_unnamed(p, ended),
        };
        match early {
            None => {
                p.add(Metric::RequestsCompleted, 1);
                if let Some(r) = req.observed {
                    // Would have been aborted, yet completed: the clocks may be too tight.
                    p.log(
                        Level::Info,
                        &format!(
                            "request_id={} completed after being observed as {} (observe mode)",
                            req.id,
                            r.as_str()
                        ),
                    );
                    return req.outcome();
                }
                // Written when the body completed: one filter-state write per request.
                (!req.complete()).then_some(OutcomeTag::Completed)
            }
            Some(reason) => {
                if p.log_enabled(Level::Debug) {
                    p.log(
                        Level::Debug,
                        &format!(
                            "request_id={} ended early (code_details={:?}, flags={flags:#x})",
                            req.id,
                            // Debug-escaped: control bytes cannot split or forge a log line.
                            String::from_utf8_lossy(details)
                        ),
                    );
                }
                let tag = decide(
                    self.mode,
                    &mut self.queue,
                    p,
                    req,
                    reason,
                    now,
                    Via::ClientGone,
                    &mut self.finished,
                );
                self.report_finished(p);
                tag.or(req.outcome())
            }
        }
    }

    /// The stream's context went away without `on_log` (safety net).
    pub fn forget<P: Platform + ?Sized>(&mut self, p: &mut P, ctx: u32) {
        if self.table.remove(&ctx).is_some() {
            p.add(Metric::ActiveRequests, -1);
        }
    }

    /// The host's tick (what the glue calls): notes a stall of this worker, then
    /// [`Engine::tick`].
    ///
    /// A tick more than two periods after the previous one means the worker did not run
    /// meanwhile (descheduled, starved of CPU, throttled, stopped): counted
    /// (`worker_stalls_total`), logged, and every abort's deadline moves on by the stall
    /// ([`AbortQueue::stalled`]). Idleness does not depend on it: it is confirmed by a
    /// second tick ([`crate::cut`]), which a late tick delays but never switches off.
    pub fn on_host_tick<P: Platform + ?Sized>(&mut self, p: &mut P) -> Vec<Action> {
        let now = p.now_ms();
        if let Some(prev) = self.last_host_tick.replace(now) {
            let gap = now.saturating_sub(prev);
            let stall = worker_stall(gap, self.cfg.tick_ms);
            if stall > 0 {
                p.add(Metric::WorkerStalls, 1);
                p.log(
                    Level::Warn,
                    &format!(
                        "this worker did not run for {stall} ms (a tick {gap} ms after the last, period {} ms); idle streams are cut only when a second tick confirms them (kvguard_filter_worker_stalls_total)",
                        self.cfg.tick_ms
                    ),
                );
                self.queue.stalled(stall);
            }
        }
        self.tick(p)
    }

    /// The tick: stamps the progress chunks counted since the last one (they read no
    /// clock), cuts what [`cut_allowed`] allows, pumps the abort queue, and returns what
    /// to do to streams (for [`apply`]). When the clock cannot be read, nothing is stamped
    /// or cut (a stale time would be early).
    pub fn tick<P: Platform + ?Sized>(&mut self, p: &mut P) -> Vec<Action> {
        let Some(now) = p.now_exact() else {
            self.pump(p);
            return Vec::new();
        };
        let mut population = 0usize;
        for req in self.table.values_mut() {
            req.stamp(now);
            population += usize::from(req.idle_clock_on());
        }
        let window = self.cfg.max_idle_timeout_ms();
        self.valve
            .open(now, window, population, self.mode == Mode::Enforce);
        let valve = &mut self.valve;
        let due: Vec<(u32, AbortReason)> = self
            .table
            .iter_mut()
            .filter_map(|(ctx, req)| cut_allowed(req, now, valve).ok().map(|r| (*ctx, r)))
            .collect();
        if let Some(held) = self.valve.close() {
            p.add(Metric::StallHolds, held.streams);
            if held.new_episode {
                p.log(
                    Level::Warn,
                    &format!(
                        "mass stall: more than {} of {} streams went idle within {window} ms; holding their closes one more idle window (kvguard_filter_stall_holds_total counts them)",
                        held.threshold,
                        self.table.len()
                    ),
                );
            }
        }
        let mut actions = Vec::with_capacity(due.len());
        for (ctx, reason) in due {
            let Some(req) = request_mut(&mut self.table, ctx) else {
                continue;
            };
            // A stall is put to kvguard-control first ([`crate::cut`]).
            let via = if req.undeferred() {
                Via::Answered
            } else if reason == AbortReason::Stalled && self.mode == Mode::Enforce {
                Via::Ask(ctx)
            } else {
                Via::Tick
            };
            if let Some(tag) = decide(
                self.mode,
                &mut self.queue,
                p,
                req,
                reason,
                now,
                via,
                &mut self.finished,
            ) {
                actions.push(match tag {
                    OutcomeTag::Observed(_) => Action::Mark { ctx, tag },
                    _ => Action::Close { ctx, tag },
                });
            }
        }
        self.pump(p);
        actions
    }

    /// Sends what is due.
    pub fn pump<P: Platform + ?Sized>(&mut self, p: &mut P) {
        let (now, unix) = (p.now_ms(), p.unix_secs());
        let mut finished = core::mem::take(&mut self.finished);
        self.queue.pump(&self.cfg, now, unix, p, &mut finished);
        self.finished = finished;
        self.report_finished(p);
    }

    /// The VM stops for good: every abort still pending is given up (`failed`, logged),
    /// so the pending gauge does not stay up.
    pub fn abandon_pending<P: Platform + ?Sized>(&mut self, p: &mut P) {
        let mut finished = core::mem::take(&mut self.finished);
        self.queue.abandon(p, &mut finished);
        self.finished = finished;
        self.report_finished(p);
    }

    /// Whether the queue has something to send now.
    pub fn has_ready_aborts(&self, now_ms: u64) -> bool {
        self.queue.has_ready(now_ms)
    }

    /// An abort call's answer (`status` `None` on timeout / reset). A stall it does not
    /// defer is closed at the next tick ([`crate::cut`]).
    pub fn on_abort_answer<P: Platform + ?Sized>(
        &mut self,
        p: &mut P,
        token: u32,
        status: Option<u16>,
        body: &[u8],
    ) {
        let now = p.now_ms();
        let mut finished = core::mem::take(&mut self.finished);
        self.queue
            .on_answer(&self.cfg, token, status, body, now, p, &mut finished);
        self.finished = finished;
        self.report_finished(p);
        self.pump(p);
    }

    fn report_finished<P: Platform + ?Sized>(&mut self, p: &mut P) {
        let now = p.now_ms();
        for (ctx, deferred) in self.queue.take_asks() {
            let Some(req) = request_mut(&mut self.table, ctx).filter(|r| r.asking()) else {
                continue;
            };
            // (Each answer is logged with its outcome below.)
            req.answered(deferred, now);
        }
        for f in self.finished.drain(..) {
            p.record(
                Metric::AbortRoundTripMs(f.outcome),
                now.saturating_sub(f.job.queued_ms()),
            );
            let level = match f.outcome {
                Outcome::Aborted | Outcome::AlreadyAborted | Outcome::NotFound => Level::Info,
                Outcome::Unauthorized | Outcome::DispatchError => Level::Error,
                _ => Level::Warn,
            };
            let status = f
                .status
                .map_or_else(|| "none".to_owned(), |s| s.to_string());
            let hint = match f.outcome {
                Outcome::Unauthorized => " (kvguard-control refused the signature: check that the filter's secret is one of its keys and that clocks agree within 30 s)",
                Outcome::DispatchError => " (the host refused the call: check control_cluster / control_target_cluster)",
                Outcome::Dropped => " (max_pending_aborts reached)",
                _ => "",
            };
            p.log(
                level,
                &format!(
                    "abort request_id={} reason={} outcome={} status={status} attempts={}{hint}",
                    f.job.id,
                    f.job.reason.as_str(),
                    f.outcome.as_str(),
                    f.job.attempts
                ),
            );
        }
    }

    /// Keeps the tick on even with nothing tracked or pending (the host renews the
    /// liveness lease on it).
    pub fn keep_ticking(&mut self, on: bool) {
        self.keep_ticking = on;
    }

    /// Whether the tick should run: requests tracked, aborts pending, or kept on.
    pub fn tick_wanted(&self) -> bool {
        self.keep_ticking || !self.table.is_empty() || self.queue.pending() > 0
    }

    /// If the tick must change (on, off, or a new `tick_ms`), records it and returns the
    /// new period in ms (0 = off).
    pub fn tick_change(&mut self) -> Option<u64> {
        let want = if self.tick_wanted() {
            self.cfg.tick_ms
        } else {
            0
        };
        if want == self.tick_period {
            return None;
        }
        self.tick_before = self.tick_period;
        self.tick_period = want;
        // A tick that starts again measures no gap (it was off, not stalled).
        self.last_host_tick = None;
        Some(want)
    }

    /// The host refused the last change: the period before it stays.
    pub fn tick_refused(&mut self) {
        self.tick_period = self.tick_before;
    }

    /// Moves the shared VM-memory gauge to `bytes` for this VM (by increments).
    pub fn report_memory<P: Platform + ?Sized>(&mut self, p: &mut P, bytes: u64) {
        if bytes != self.memory_reported {
            let delta = i128::from(bytes) - i128::from(self.memory_reported);
            p.add(Metric::VmMemoryBytes, i64::try_from(delta).unwrap_or(0));
            self.memory_reported = bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aborts::{BACKOFF_MAX_MS, DEADLINE_MS};
    use crate::request::flags;
    use crate::testing::{config, MockHost, SECRET};
    use kvguard_contract::{Key, RequestId};

    fn engine(extra: &str) -> (Engine, MockHost) {
        let h = MockHost {
            now: 1_000,
            unix: 1_700_000_000,
            ..MockHost::default()
        };
        (Engine::new(config(extra), 5), h)
    }

    /// The tick's actions when it cuts stream `ctx` alone as stalled.
    fn stalled_cut(ctx: u32) -> Vec<Action> {
        vec![Action::Close {
            ctx,
            tag: OutcomeTag::Aborted(AbortReason::Stalled),
        }]
    }

    fn track(e: &mut Engine, h: &mut MockHost, ctx: u32, id: &str) {
        assert_eq!(
            e.on_request_headers(
                h,
                ctx,
                Some(b"/v1/chat/completions"),
                Some(id.as_bytes()),
                false
            ),
            Verdict::Tracked
        );
    }

    fn sse(e: &mut Engine, h: &mut MockHost, ctx: u32) {
        assert_eq!(
            e.on_response_headers(h, ctx, Some(b"text/event-stream"), None, None, false),
            BodyNeed::Bytes
        );
    }

    /// The tests feed bodies through the production path, [`Engine::on_chunk`] (`len`
    /// counts only when `chunk` is empty: an opaque body's length).
    trait Feed {
        fn on_response_body(
            &mut self,
            h: &mut MockHost,
            ctx: u32,
            chunk: &[u8],
            len: usize,
            eos: bool,
        ) -> Option<OutcomeTag>;
    }

    impl Feed for Engine {
        fn on_response_body(
            &mut self,
            h: &mut MockHost,
            ctx: u32,
            chunk: &[u8],
            len: usize,
            eos: bool,
        ) -> Option<OutcomeTag> {
            let len = if chunk.is_empty() { len } else { chunk.len() };
            self.on_chunk(h, ctx, len, eos, || Some(chunk.to_vec()))
        }
    }

    /// Two ticks at the same time: the first arms what is idle, the second cuts it
    /// (nothing arrived in between). Returns the second's actions.
    fn confirmed_tick(e: &mut Engine, h: &mut MockHost) -> Vec<Action> {
        let armed = e.tick(h);
        assert!(
            armed.iter().all(|a| !matches!(
                a,
                Action::Close {
                    tag: OutcomeTag::Aborted(AbortReason::Stalled | AbortReason::FirstTokenTimeout),
                    ..
                } | Action::Mark {
                    tag: OutcomeTag::Observed(
                        AbortReason::Stalled | AbortReason::FirstTokenTimeout
                    ),
                    ..
                }
            )),
            "idle cut at its first tick: {armed:?}"
        );
        let mut all = armed;
        all.extend(ended(e, h));
        all
    }

    /// A tick whose stalls kvguard-control ends at once (as it does for a silent engine),
    /// and the next tick, at the same time, that closes them: what both close.
    fn ended(e: &mut Engine, h: &mut MockHost) -> Vec<Action> {
        let mut all = e.tick(h);
        all.extend(answer_asks(e, h, 200, r#"{"found":true,"aborted":true}"#));
        all
    }

    /// Answers every abort call that asked (`recheck_ms`) with `status` and `answer`
    /// (calls already answered are ignored by the queue); returns what the answers close
    /// (at a tick at the same time, when one asked).
    fn answer_asks(e: &mut Engine, h: &mut MockHost, status: u16, answer: &str) -> Vec<Action> {
        let tokens: Vec<u32> = h
            .calls
            .iter()
            .filter(|c| memchr::memmem::find(&c.3, br#""recheck_ms":"#).is_some())
            .map(|c| c.0)
            .collect();
        for t in &tokens {
            e.on_abort_answer(h, *t, Some(status), answer.as_bytes());
        }
        if tokens.is_empty() {
            return Vec::new();
        }
        e.tick(h)
    }

    fn body(h: &MockHost, i: usize) -> String {
        String::from_utf8(h.calls[i].3.clone()).unwrap()
    }

    #[test]
    fn tracking_rules() {
        let (mut e, mut h) = engine("");
        assert_eq!(
            e.on_request_headers(&mut h, 1, Some(b"/v1/models"), Some(b"a"), false),
            Verdict::NotMatching
        );
        assert_eq!(
            e.on_request_headers(&mut h, 1, None, Some(b"a"), false),
            Verdict::NotMatching
        );
        assert_eq!(
            e.on_request_headers(&mut h, 1, Some(b"/v1/completions"), None, false),
            Verdict::Untracked(Some(Untracked::NoRequestId))
        );
        assert_eq!(
            e.on_request_headers(
                &mut h,
                1,
                Some(b"/v1/completions"),
                Some(&[0xff, 0xfe]),
                false
            ),
            Verdict::Untracked(Some(Untracked::BadRequestId))
        );
        assert_eq!(
            h.metric(Metric::RequestsUntracked(Untracked::NoRequestId)),
            1
        );
        assert_eq!(
            h.metric(Metric::RequestsUntracked(Untracked::BadRequestId)),
            1
        );
        assert_eq!(e.tracked(), 0);
        assert_eq!(e.tick_change(), None);
        track(&mut e, &mut h, 2, "r2");
        assert_eq!(h.metric(Metric::RequestsTracked), 1);
        assert_eq!(h.metric(Metric::ActiveRequests), 1);
        assert_eq!(e.tick_change(), Some(250));
        assert_eq!(e.tick_change(), None);
        // Untracked contexts are ignored everywhere.
        assert_eq!(
            e.on_response_headers(&mut h, 9, Some(b"text/event-stream"), None, None, false),
            BodyNeed::Nothing
        );
        assert_eq!(
            e.on_response_body(&mut h, 9, b"data: [DONE]\n\n", 14, true),
            None
        );
        assert_eq!(e.on_log(&mut h, 9, b"", 0), None);
    }

    #[test]
    fn a_context_reused_without_on_log_replaces_its_stale_request() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "old");
        track(&mut e, &mut h, 2, "other");
        assert_eq!(e.tracked(), 2);
        track(&mut e, &mut h, 1, "new");
        assert_eq!(e.tracked(), 2);
        assert_eq!(
            e.request(1).map(|r| r.id.to_string()),
            Some("new".to_owned())
        );
        // The gauge counts streams, not headers seen.
        assert_eq!(h.metric(Metric::ActiveRequests), 2);
        assert!(h
            .logs
            .iter()
            .any(|(l, m)| *l == Level::Warn && m.contains("dropping stale request old")));
    }

    #[test]
    fn per_request_histograms_are_recorded_once_at_the_end() {
        let (mut e, mut h) = engine("");
        let t0 = h.now;
        track(&mut e, &mut h, 1, "r1");
        sse(&mut e, &mut h, 1);
        let ev = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
        h.now = t0 + 100;
        e.on_response_body(&mut h, 1, ev, 0, false);
        // A tick inside the gap: the chunk after it reads the clock and measures the gap.
        h.now = t0 + 250;
        assert!(e.tick(&mut h).is_empty());
        h.now = t0 + 400;
        e.on_response_body(&mut h, 1, ev, 0, false);
        h.now = t0 + 450;
        e.on_response_body(&mut h, 1, ev, 0, false);
        // Nothing before the end: no host call per event.
        assert!(h.observations.is_empty());
        h.now = t0 + 500;
        e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false);
        e.on_log(&mut h, 1, b"", 0);
        let c = Ended::Completed;
        assert_eq!(h.observed(Metric::FirstTokenMs(c)), vec![100]);
        assert_eq!(h.observed(Metric::MaxTokenGapMs(c)), vec![300]);
        assert_eq!(h.observed(Metric::StreamDurationMs(c)), vec![500]);
        assert_eq!(h.observations.len(), 3);
        // An aborted request's histograms carry its outcome.
        track(&mut e, &mut h, 2, "r2");
        sse(&mut e, &mut h, 2);
        e.on_response_body(&mut h, 2, ev, 0, false);
        h.now += 50;
        e.on_log(&mut h, 2, b"downstream_remote_disconnect", flags::DC);
        assert_eq!(
            h.observed(Metric::StreamDurationMs(Ended::Aborted)),
            vec![50]
        );
        assert_eq!(h.observed(Metric::FirstTokenMs(Ended::Aborted)), vec![0]);
    }

    #[test]
    fn normal_completion_sends_nothing() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "r1");
        sse(&mut e, &mut h, 1);
        assert_eq!(
            e.on_response_body(
                &mut h,
                1,
                b"data: {\"choices\":[{\"index\":0,\"finish_reason\":null}]}\n\n",
                0,
                false
            ),
            None
        );
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false),
            Some(OutcomeTag::Completed)
        );
        assert_eq!(e.body_need(1), BodyNeed::Nothing);
        // Even if the client goes away now, a completed request is not aborted (and its
        // `completed` outcome, written at [DONE], is not written twice).
        assert_eq!(
            e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC),
            None
        );
        e.pump(&mut h);
        assert!(h.calls.is_empty());
        assert_eq!(h.metric(Metric::RequestsCompleted), 1);
        assert_eq!(h.metric(Metric::ActiveRequests), 0);
        assert_eq!(e.tick_change(), None); // never turned on in this test
    }

    #[test]
    fn end_details_are_read_only_when_they_can_matter() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        assert!(!e.end_details_needed(9), "untracked");
        track(&mut e, &mut h, 1, "d1");
        sse(&mut e, &mut h, 1);
        assert!(e.end_details_needed(1), "in flight: the end decides");
        e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false);
        assert!(!e.end_details_needed(1), "complete: nothing to classify");
        track(&mut e, &mut h, 2, "d2");
        sse(&mut e, &mut h, 2);
        e.on_response_body(&mut h, 2, b"data: {}\n\n", 0, false);
        h.now += 100;
        let _ = confirmed_tick(&mut e, &mut h);
        assert!(!e.end_details_needed(2), "already decided");
        let (mut e, mut h) = engine(r#","mode":"observe","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 3, "d3");
        sse(&mut e, &mut h, 3);
        e.on_response_body(&mut h, 3, b"data: {}\n\n", 0, false);
        h.now += 100;
        let _ = confirmed_tick(&mut e, &mut h);
        assert!(
            e.end_details_needed(3),
            "observed: a later completion is still told"
        );
    }

    #[test]
    fn disconnect_queues_one_abort_and_dispatches() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "r1");
        sse(&mut e, &mut h, 1);
        e.on_response_body(&mut h, 1, b"data: {}\n\ndata: {}\n\n", 0, false);
        h.now += 700;
        assert_eq!(
            e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        assert_eq!(e.pending_aborts(), 1);
        assert!(e.has_ready_aborts(h.now));
        assert_eq!(e.tick_change(), Some(250));
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 1);
        assert_eq!(h.calls[0].1, "kvguard");
        assert_eq!(
            body(&h, 0),
            r#"{"request_id":"r1","reason":"downstream_reset","age_ms":700,"tokens":2,"idle_ms":700,"gone_ms":0,"attempt":1}"#
        );
        let token = h.calls[0].0;
        e.on_abort_answer(
            &mut h,
            token,
            Some(200),
            br#"{"request_id":"r1","found":true,"aborted":true}"#,
        );
        assert_eq!(e.pending_aborts(), 0);
        assert_eq!(
            h.metric(Metric::Aborts(
                AbortReason::DownstreamReset,
                Outcome::Aborted
            )),
            1
        );
        let info = h
            .logs
            .iter()
            .find(|(_, m)| m.contains("outcome=aborted"))
            .unwrap();
        assert_eq!(info.0, Level::Info);
        assert!(info.1.contains("request_id=r1") && info.1.contains("reason=downstream_reset"));
        assert_eq!(e.tick_change(), Some(0)); // nothing left: the tick goes off
    }

    #[test]
    fn gone_ms_counts_from_the_disconnect_at_each_attempt() {
        let (mut e, mut h) = engine(r#","abort_retries":1"#);
        track(&mut e, &mut h, 1, "g1");
        sse(&mut e, &mut h, 1);
        e.on_response_body(
            &mut h,
            1,
            b"data: {}

",
            0,
            false,
        );
        h.now += 300;
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        h.now += 20;
        e.pump(&mut h);
        assert!(body(&h, 0).ends_with(r#""idle_ms":320,"gone_ms":20,"attempt":1}"#));
        let t = h.calls[0].0;
        e.on_abort_answer(&mut h, t, Some(503), b"");
        h.now += 5_000;
        e.tick(&mut h);
        assert!(body(&h, 1).ends_with(r#""idle_ms":5320,"gone_ms":5020,"attempt":2}"#));
    }

    #[test]
    fn disconnect_while_queued_before_response_headers() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "q1");
        assert_eq!(
            e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        e.pump(&mut h);
        // No data event seen: no idle_ms.
        assert!(body(&h, 0).ends_with(r#""tokens":0,"gone_ms":0,"attempt":1}"#));
    }

    #[test]
    fn a_worker_stall_is_a_tick_more_than_two_periods_late() {
        assert_eq!(worker_stall(250, 250), 0);
        assert_eq!(worker_stall(500, 250), 0, "a loaded loop, not a stall");
        assert_eq!(worker_stall(501, 250), 251);
        assert_eq!(worker_stall(2_550, 50), 2_500);
        assert_eq!(worker_stall(0, 250), 0);
    }

    /// Envoy stopped 2.5 s (idle timeout 1 s, tick 50 ms): the late tick closes nothing
    /// for idleness, the tokens read just after it keep the flowing stream alive, the
    /// silent stream is closed at the next tick (one tick late, whatever the stop's
    /// length), and max age is not held.
    #[test]
    fn after_a_worker_stall_an_idle_stream_is_cut_one_tick_later() {
        let (mut e, mut h) = engine(
            r#","idle_timeout_ms":1000,"tick_ms":50,"routes":[{"path_prefix":"/v1/chat/completions/aged","max_age_ms":2000}]"#,
        );
        track(&mut e, &mut h, 1, "flowing");
        track(&mut e, &mut h, 2, "silent");
        assert_eq!(
            e.on_request_headers(
                &mut h,
                3,
                Some(b"/v1/chat/completions/aged"),
                Some(b"aged"),
                false
            ),
            Verdict::Tracked
        );
        for ctx in [1, 2, 3] {
            sse(&mut e, &mut h, ctx);
            e.on_response_body(&mut h, ctx, b"data: {}\n\n", 0, false);
        }
        for _ in 0..4 {
            h.now += 50;
            e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
            e.on_response_body(&mut h, 3, b"data: {}\n\n", 0, false);
            assert!(e.on_host_tick(&mut h).is_empty());
        }
        assert_eq!(h.metric(Metric::WorkerStalls), 0, "on-time ticks");
        // The worker does not run for 2.5 s; its first tick comes before Envoy reads what
        // the flowing stream's engine sent meanwhile.
        h.now += 2_550;
        assert!(
            e.on_host_tick(&mut h).is_empty(),
            "nothing closed for idleness"
        );
        assert_eq!(h.metric(Metric::WorkerStalls), 1);
        assert!(h
            .logs
            .iter()
            .any(|(l, m)| *l == Level::Warn && m.contains("did not run for 2500 ms")));
        // Envoy reads the flowing streams' tokens; the next tick cuts the silent one, and
        // the aged one (2 s: max age is not idleness, whatever it sent).
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        e.on_response_body(&mut h, 3, b"data: {}\n\n", 0, false);
        h.now += 50;
        let mut closed = e.on_host_tick(&mut h);
        closed.extend(answer_asks(&mut e, &mut h, 200, r#"{"aborted":true}"#));
        closed.sort_by_key(|a| match a {
            Action::Close { ctx, .. } | Action::Mark { ctx, .. } => *ctx,
        });
        assert_eq!(
            closed,
            vec![
                Action::Close {
                    ctx: 2,
                    tag: OutcomeTag::Aborted(AbortReason::Stalled)
                },
                Action::Close {
                    ctx: 3,
                    tag: OutcomeTag::Aborted(AbortReason::MaxAge)
                }
            ]
        );
        assert_eq!(h.metric(Metric::WorkerStalls), 1);
    }

    /// Issue 27.1: a worker whose ticks always come late (CPU-throttled: every tick three
    /// periods after the last) still cuts a silent stream; the hold measured by the ticks'
    /// lateness switched idleness off for good.
    #[test]
    fn chronically_late_ticks_still_cut_a_silent_stream() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":1000,"tick_ms":250"#);
        stream(&mut e, &mut h, 1);
        track(&mut e, &mut h, 2, "flowing");
        sse(&mut e, &mut h, 2);
        e.on_response_body(&mut h, 2, b"data: {}\n\n", 0, false);
        let mut cut = None;
        for _ in 0..20 {
            h.now += 750;
            e.on_response_body(&mut h, 2, b"data: {}\n\n", 0, false);
            let mut a = e.on_host_tick(&mut h);
            a.extend(answer_asks(&mut e, &mut h, 200, r#"{"aborted":true}"#));
            if !a.is_empty() {
                cut = Some((a, h.now));
                break;
            }
        }
        let (a, at) = cut.expect("the silent stream is never cut");
        assert_eq!(a, stalled_cut(1));
        // Due at the first tick past 1 s of silence (2 500 ms), confirmed at the next.
        assert_eq!(at, 1_000 + 750 * 3);
        assert!(h.metric(Metric::WorkerStalls) >= 2);
    }

    /// A tick switched off (nothing tracked) and on again is not a stall.
    #[test]
    fn a_tick_started_again_is_not_a_worker_stall() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":1000,"tick_ms":50"#);
        track(&mut e, &mut h, 1, "a");
        assert_eq!(e.tick_change(), Some(50));
        assert!(e.on_host_tick(&mut h).is_empty());
        e.forget(&mut h, 1);
        assert_eq!(e.tick_change(), Some(0));
        h.now += 60_000;
        track(&mut e, &mut h, 2, "b");
        assert_eq!(e.tick_change(), Some(50));
        h.now += 50;
        assert!(e.on_host_tick(&mut h).is_empty());
        h.now += 50;
        assert!(e.on_host_tick(&mut h).is_empty());
        assert_eq!(h.metric(Metric::WorkerStalls), 0);
        // A reconfiguration (the period may change) measures no gap either.
        e.reconfigure(&mut h, config(r#","idle_timeout_ms":1000,"tick_ms":10"#));
        h.now += 50;
        assert!(e.on_host_tick(&mut h).is_empty());
        assert_eq!(h.metric(Metric::WorkerStalls), 0);
    }

    #[test]
    fn tick_reaps_stalled_and_closes_once() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "s1");
        track(&mut e, &mut h, 2, "s2");
        sse(&mut e, &mut h, 1);
        sse(&mut e, &mut h, 2);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        e.on_response_body(&mut h, 2, b"data: {}\n\n", 0, false);
        h.now += 50;
        e.on_response_body(&mut h, 2, b": keep-alive\n\n", 0, false);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.now += 60;
        // Stream 2 only sent keep-alives for 110 ms: stalled. Stream 1 progressed.
        let actions = confirmed_tick(&mut e, &mut h);
        assert_eq!(actions, stalled_cut(2));
        assert_eq!(h.calls.len(), 1);
        assert!(body(&h, 0).contains(r#""reason":"stalled""#));
        // Idle since its last data event (110 ms); the client was still connected.
        assert!(
            body(&h, 0).ends_with(r#""idle_ms":110,"attempt":1,"recheck_ms":100}"#),
            "{}",
            body(&h, 0)
        );
        // No second decision on the next tick, nor at on_log.
        h.now += 1000;
        let actions = confirmed_tick(&mut e, &mut h);
        assert_eq!(actions.len(), 1); // stream 1 now stalls too
        assert_eq!(
            e.on_log(&mut h, 2, b"wasm_fail_stream", flags::LR),
            Some(OutcomeTag::Aborted(AbortReason::Stalled))
        );
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 2);
    }

    #[test]
    fn first_token_timeout_and_max_age_with_routes() {
        let (mut e, mut h) = engine(
            r#","first_token_timeout_ms":200,"routes":[{"path_prefix":"/v1/completions","max_age_ms":300,"first_token_timeout_ms":0}]"#,
        );
        track(&mut e, &mut h, 1, "f1");
        assert_eq!(
            e.on_request_headers(&mut h, 2, Some(b"/v1/completions"), Some(b"m2"), false),
            Verdict::Tracked
        );
        h.now += 200;
        let a = confirmed_tick(&mut e, &mut h);
        assert_eq!(
            a,
            vec![Action::Close {
                ctx: 1,
                tag: OutcomeTag::Aborted(AbortReason::FirstTokenTimeout)
            }]
        );
        h.now += 100;
        let a = e.tick(&mut h);
        assert_eq!(
            a,
            vec![Action::Close {
                ctx: 2,
                tag: OutcomeTag::Aborted(AbortReason::MaxAge)
            }]
        );
    }

    #[test]
    fn observe_mode_sends_and_closes_nothing() {
        let (mut e, mut h) = engine(r#","mode":"observe","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "o1");
        sse(&mut e, &mut h, 1);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.now += 100;
        let a = confirmed_tick(&mut e, &mut h);
        assert_eq!(
            a,
            vec![Action::Mark {
                ctx: 1,
                tag: OutcomeTag::Observed(AbortReason::Stalled)
            }]
        );
        assert_eq!(h.metric(Metric::WouldAbort(AbortReason::Stalled)), 1);
        assert!(h
            .logs
            .iter()
            .any(|(l, m)| *l == Level::Info
                && m.contains("would abort request_id=o1 reason=stalled")));
        // The stream goes on; a disconnect later does not count again.
        assert_eq!(
            e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Observed(AbortReason::Stalled))
        );
        track(&mut e, &mut h, 2, "o2");
        assert_eq!(
            e.on_log(&mut h, 2, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Observed(AbortReason::DownstreamReset))
        );
        e.pump(&mut h);
        assert!(h.calls.is_empty());
        assert_eq!(e.pending_aborts(), 0);
    }

    #[test]
    fn observe_mode_keeps_reading_and_tells_a_later_completion() {
        let (mut e, mut h) = engine(r#","mode":"observe","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "o1");
        sse(&mut e, &mut h, 1);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.now += 100;
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 1);
        assert_eq!(e.body_need(1), BodyNeed::Bytes);
        // No second decision while it goes on.
        h.now += 1000;
        assert!(e.tick(&mut h).is_empty());
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false),
            None
        );
        assert_eq!(e.body_need(1), BodyNeed::Nothing);
        assert_eq!(
            e.on_log(&mut h, 1, b"via_upstream", 0),
            Some(OutcomeTag::Observed(AbortReason::Stalled))
        );
        assert_eq!(h.metric(Metric::RequestsCompleted), 1);
        assert!(h
            .logs
            .iter()
            .any(|(_, m)| m.contains("completed after being observed as stalled")));
        assert!(h.calls.is_empty());
    }

    fn stamp_for(id: &str, addr: &str, key: &str) -> String {
        kvguard_contract::stamp::stamp(
            &Key::try_new(key.as_bytes()).unwrap(),
            addr.parse().unwrap(),
            &RequestId::try_new(id.as_bytes()).unwrap(),
            1,
        )
    }

    #[test]
    fn the_replicas_of_streams_in_flight_are_listed_once_each_and_at_most_max_replicas() {
        let extra =
            r#","control_target_cluster":"kvguard_replica","control_target_cidrs":["10.0.0.0/8"]"#;
        let (mut e, mut h) = engine(extra);
        assert!(e.targets().is_empty());
        let max = crate::lease::MAX_REPLICAS;
        // Two streams on replica 0, one on each of max + 2 others, one unstamped.
        for i in 0..(max + 4) {
            let id = format!("t{i}");
            let replica = i.saturating_sub(1);
            track(&mut e, &mut h, i as u32 + 1, &id);
            let st = stamp_for(&id, &format!("10.0.0.{replica}:9902"), SECRET);
            let stamp = (i + 1 < max + 4).then_some(st.as_bytes());
            e.on_response_headers(
                &mut h,
                i as u32 + 1,
                Some(b"text/event-stream"),
                None,
                stamp,
                false,
            );
        }
        let mut t = e.targets();
        assert_eq!(t.len(), max, "{t:?}");
        t.sort();
        t.dedup();
        assert_eq!(t.len(), max, "each once");
        // Fewer replicas than the bound: every one of them.
        let (mut e, mut h) = engine(extra);
        for (i, r) in ["10.0.0.1:9902", "10.0.0.2:9902", "10.0.0.1:9902"]
            .iter()
            .enumerate()
        {
            let id = format!("u{i}");
            track(&mut e, &mut h, i as u32 + 1, &id);
            let st = stamp_for(&id, r, SECRET);
            e.on_response_headers(
                &mut h,
                i as u32 + 1,
                Some(b"text/event-stream"),
                None,
                Some(st.as_bytes()),
                false,
            );
        }
        let mut t = e.targets();
        t.sort();
        let want: Vec<core::net::SocketAddr> = vec![
            "10.0.0.1:9902".parse().unwrap(),
            "10.0.0.2:9902".parse().unwrap(),
        ];
        assert_eq!(t, want);
    }

    #[test]
    fn per_replica_routing_and_rejected_stamps() {
        let extra = r#","control_target_cluster":"kvguard_replica","control_target_cidrs":["10.0.0.0/8","127.0.0.1"]"#;
        // Stamps on the default port (9902) only.
        let (mut e, mut h) = engine(extra);
        let good = stamp_for("p1", "10.1.2.3:9902", SECRET);
        track(&mut e, &mut h, 1, "p1");
        e.on_response_headers(
            &mut h,
            1,
            Some(b"text/event-stream"),
            None,
            Some(good.as_bytes()),
            false,
        );
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        e.pump(&mut h);
        assert_eq!(h.calls[0].1, "kvguard_replica");
        assert!(h.calls[0]
            .2
            .contains(&("x-envoy-original-dst-host", "10.1.2.3:9902".to_owned())));
        assert_eq!(
            h.metric(Metric::AbortRoutes(crate::metrics::Route::Replica)),
            1
        );

        // Forged (other key), stamped for another id, outside the CIDRs, malformed.
        let cases = [
            (
                stamp_for("p2", "10.1.2.3:9902", "another-secret-0123456789"),
                StampRejected::Mismatch,
            ),
            (
                stamp_for("other", "10.1.2.3:9902", SECRET),
                StampRejected::Mismatch,
            ),
            (
                stamp_for("p2", "192.168.1.1:9902", SECRET),
                StampRejected::OutsideCidrs,
            ),
            ("garbage".to_owned(), StampRejected::Malformed),
            (
                stamp_for("p2", "10.1.2.3:9902", SECRET).replace(";v2=", ";sig="),
                StampRejected::Outdated,
            ),
        ];
        for (i, (value, cause)) in cases.iter().enumerate() {
            let ctx = 10 + i as u32;
            track(&mut e, &mut h, ctx, "p2");
            e.on_response_headers(
                &mut h,
                ctx,
                Some(b"text/event-stream"),
                None,
                Some(value.as_bytes()),
                false,
            );
            assert_eq!(e.request(ctx).unwrap().target, None);
            assert!(h.metric(Metric::StampRejected(*cause)) >= 1);
            e.on_log(&mut h, ctx, b"downstream_remote_disconnect", flags::DC);
        }
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 6);
        assert!(h.calls[1..].iter().all(
            |c| c.1 == "kvguard" && !c.2.iter().any(|(k, _)| *k == "x-envoy-original-dst-host")
        ));
        assert_eq!(
            h.metric(Metric::AbortRoutes(crate::metrics::Route::Fallback)),
            5
        );
    }

    #[test]
    fn stamps_verify_with_every_rotation_key_and_allowed_ports_only() {
        const NEW: &str = "the-next-secret-0123456789";
        let extra = format!(
            r#","secret":"{SECRET}\n{NEW}","control_target_cluster":"r","control_target_cidrs":["10.0.0.0/8"],"control_target_ports":[9902,9903]"#
        );
        let json = format!(r#"{{"control_cluster":"kvguard"{extra}}}"#);
        let cfg = Config::parse(json.as_bytes(), &|_| None).unwrap();
        assert_eq!(
            cfg.key,
            Key::try_new(SECRET.as_bytes()).unwrap(),
            "the first line signs"
        );
        let (mut e, mut h) = (Engine::new(cfg, 1), MockHost::default());
        for (ctx, key, addr, routed) in [
            (1, SECRET, "10.0.0.1:9902", true),
            (2, NEW, "10.0.0.1:9903", true),
            (3, SECRET, "10.0.0.1:22", false),
        ] {
            let id = format!("k{ctx}");
            track(&mut e, &mut h, ctx, &id);
            let st = stamp_for(&id, addr, key);
            e.on_response_headers(
                &mut h,
                ctx,
                Some(b"text/event-stream"),
                None,
                Some(st.as_bytes()),
                false,
            );
            assert_eq!(e.request(ctx).unwrap().target.is_some(), routed, "{addr}");
        }
        assert_eq!(
            h.metric(Metric::StampRejected(StampRejected::PortNotAllowed)),
            1
        );
        assert_eq!(h.metric(Metric::StampRejected(StampRejected::Mismatch)), 0);
        // Aborts are signed with the first key only.
        e.on_log(&mut h, 2, b"downstream_remote_disconnect", flags::DC);
        e.pump(&mut h);
        let sig = h.calls[0]
            .2
            .iter()
            .find(|(k, _)| *k == "x-kvguard-signature")
            .map(|(_, v)| v.clone())
            .unwrap();
        let old = Key::try_new(SECRET.as_bytes()).unwrap();
        assert!(kvguard_contract::signature::verify(
            kvguard_contract::Domain::Abort,
            std::slice::from_ref(&old),
            Some(sig.as_bytes()),
            &h.calls[0].3,
            h.unix
        )
        .is_ok());
    }

    #[test]
    fn stamp_ignored_without_target_route() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "p1");
        let good = stamp_for("p1", "10.1.2.3:9902", SECRET);
        e.on_response_headers(
            &mut h,
            1,
            Some(b"text/event-stream"),
            None,
            Some(good.as_bytes()),
            false,
        );
        assert_eq!(e.request(1).unwrap().target, None);
    }

    #[test]
    fn anomalies_and_opaque_bodies() {
        let (mut e, mut h) = engine(r#","max_event_bytes":256,"first_token_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "a1");
        assert_eq!(
            e.on_response_headers(
                &mut h,
                1,
                Some(b"text/event-stream"),
                Some(b"gzip"),
                None,
                false
            ),
            BodyNeed::Length
        );
        assert_eq!(h.metric(Metric::ParseAnomalies(Anomaly::Compressed)), 1);
        e.on_response_body(&mut h, 1, &[], 10, false);
        h.now += 150;
        // Bytes of an opaque body are progress: no first-token timeout.
        assert!(e.tick(&mut h).is_empty());
        e.on_response_body(&mut h, 1, &[], 0, true);
        assert_eq!(
            e.on_log(&mut h, 1, b"via_upstream", 0),
            Some(OutcomeTag::Completed)
        );

        track(&mut e, &mut h, 2, "a2");
        sse(&mut e, &mut h, 2);
        let big = format!("data: {}\n\ndata: {{\n\n", "x".repeat(300));
        e.on_response_body(&mut h, 2, big.as_bytes(), 0, false);
        assert_eq!(h.metric(Metric::ParseAnomalies(Anomaly::OversizedEvent)), 1);
        assert_eq!(h.metric(Metric::ParseAnomalies(Anomaly::MalformedJson)), 1);
        assert_eq!(e.request(2).unwrap().events(), 2);

        track(&mut e, &mut h, 3, "a3");
        assert_eq!(
            e.on_response_headers(&mut h, 3, Some(b"application/json"), None, None, true),
            BodyNeed::Nothing
        );
        assert_eq!(
            e.on_log(&mut h, 3, b"via_upstream", 0),
            Some(OutcomeTag::Completed)
        );
        assert_eq!(h.metric(Metric::ParseAnomalies(Anomaly::OpaqueBody)), 0);
    }

    #[test]
    fn full_queue_drops_and_logs() {
        let (mut e, mut h) = engine(r#","max_pending_aborts":1"#);
        for ctx in 1..=2 {
            track(&mut e, &mut h, ctx, &format!("d{ctx}"));
            e.on_log(&mut h, ctx, b"downstream_remote_disconnect", flags::DC);
        }
        assert_eq!(e.pending_aborts(), 1);
        assert_eq!(
            h.metric(Metric::Aborts(
                AbortReason::DownstreamReset,
                Outcome::Dropped
            )),
            1
        );
        assert!(h.logs.iter().any(|(l, m)| *l == Level::Warn
            && m.contains("outcome=dropped")
            && m.contains("status=none")
            && m.contains("(max_pending_aborts reached)")));
    }

    #[test]
    fn unauthorized_is_loud_and_not_retried() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "u1");
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        e.pump(&mut h);
        let t = h.calls[0].0;
        e.on_abort_answer(&mut h, t, Some(401), b"");
        assert_eq!(h.calls.len(), 1);
        assert!(h.logs.iter().any(|(l, m)| *l == Level::Error
            && m.contains("outcome=unauthorized")
            && m.contains("status=401")
            && m.contains("check that the filter's secret is one of its keys")));
        assert_eq!(e.pending_aborts(), 0);
    }

    #[test]
    fn transient_failure_retries_from_tick() {
        let (mut e, mut h) = engine(r#","abort_retries":1"#);
        track(&mut e, &mut h, 1, "t1");
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        e.pump(&mut h);
        let t = h.calls[0].0;
        e.on_abort_answer(&mut h, t, None, b"");
        assert_eq!(e.pending_aborts(), 1);
        assert!(e.tick_wanted());
        h.now += 1000;
        e.tick(&mut h);
        assert_eq!(h.calls.len(), 2);
        let t = h.calls[1].0;
        e.on_abort_answer(&mut h, t, Some(503), b"");
        assert_eq!(e.pending_aborts(), 0);
        assert_eq!(
            h.metric(Metric::Aborts(
                AbortReason::DownstreamReset,
                Outcome::Failed
            )),
            1
        );
        assert_eq!(h.metric(Metric::AbortAttempts), 2);
        assert!(!e.tick_wanted());
    }

    #[test]
    fn an_abort_s_round_trip_counts_from_its_decision() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "r1");
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        h.now += 30;
        e.pump(&mut h);
        h.now += 40;
        let t = h.calls[0].0;
        e.on_abort_answer(&mut h, t, Some(200), br#"{"aborted":true}"#);
        assert_eq!(
            h.observed(Metric::AbortRoundTripMs(Outcome::Aborted)),
            vec![70]
        );
    }

    #[test]
    fn a_call_the_host_refuses_is_loud_and_names_the_clusters() {
        let (mut e, mut h) = engine("");
        h.refuse = Some(crate::host::DispatchError::BadArgument);
        track(&mut e, &mut h, 1, "r1");
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        e.pump(&mut h);
        assert_eq!(e.pending_aborts(), 0);
        assert!(h.logs.iter().any(|(l, m)| *l == Level::Error
            && m.contains("outcome=dispatch_error")
            && m.contains("check control_cluster")));
    }

    #[test]
    fn aborts_are_ready_only_when_one_is_due() {
        let (mut e, mut h) = engine(r#","abort_retries":1"#);
        assert!(!e.has_ready_aborts(h.now));
        track(&mut e, &mut h, 1, "r1");
        e.on_log(&mut h, 1, b"downstream_remote_disconnect", flags::DC);
        assert!(e.has_ready_aborts(h.now));
        e.pump(&mut h);
        assert!(!e.has_ready_aborts(h.now), "in flight");
        let t = h.calls[0].0;
        e.on_abort_answer(&mut h, t, Some(503), b"");
        assert!(!e.has_ready_aborts(h.now), "backing off");
        assert!(e.has_ready_aborts(h.now + BACKOFF_MAX_MS));
    }

    #[test]
    fn stopping_the_vm_gives_up_its_pending_aborts() {
        let (mut e, mut h) = engine("");
        for ctx in 1..=2 {
            track(&mut e, &mut h, ctx, &format!("r{ctx}"));
            e.on_log(&mut h, ctx, b"downstream_remote_disconnect", flags::DC);
        }
        e.pump(&mut h);
        assert_eq!(e.pending_aborts(), 2);
        e.abandon_pending(&mut h);
        assert_eq!(e.pending_aborts(), 0);
        assert_eq!(h.metric(Metric::PendingAborts), 0);
        assert_eq!(
            h.metric(Metric::Aborts(
                AbortReason::DownstreamReset,
                Outcome::Failed
            )),
            2
        );
        assert_eq!(
            h.logs
                .iter()
                .filter(|(l, m)| *l == Level::Warn && m.contains("outcome=failed"))
                .count(),
            2
        );
    }

    #[test]
    fn the_tick_can_be_kept_on_with_nothing_tracked() {
        let (mut e, _) = engine("");
        assert_eq!(e.tick_change(), None);
        e.keep_ticking(true);
        assert!(e.tick_wanted());
        assert_eq!(e.tick_change(), Some(250));
        e.keep_ticking(false);
        assert_eq!(e.tick_change(), Some(0));
    }

    #[test]
    fn a_tick_change_the_host_refused_is_asked_again() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "r1");
        assert_eq!(e.tick_change(), Some(250));
        // The host refused to start the tick: the next check asks again.
        e.tick_refused();
        assert_eq!(e.tick_change(), Some(250));
        assert_eq!(e.tick_change(), None);
    }

    #[test]
    fn memory_gauge_moves_by_deltas() {
        let (mut e, mut h) = engine("");
        e.report_memory(&mut h, 1000);
        e.report_memory(&mut h, 1500);
        e.report_memory(&mut h, 1200);
        assert_eq!(h.metric(Metric::VmMemoryBytes), 1200);
        e.report_memory(&mut h, 0);
        assert_eq!(h.metric(Metric::VmMemoryBytes), 0);
    }

    fn stream(e: &mut Engine, h: &mut MockHost, ctx: u32) {
        track(e, h, ctx, &format!("m{ctx}"));
        sse(e, h, ctx);
        e.on_response_body(h, ctx, b"data: {}\n\n", 0, false);
    }

    const DEFERRED: &[u8] = br#"{"request_id":"m1","found":true,"deferred":true}"#;

    /// A stall of stream 1 (idle 100 ms) armed and asked: the tick that asks closes
    /// nothing; returns the ask's token.
    fn stall_asked(e: &mut Engine, h: &mut MockHost) -> u32 {
        h.now += 100;
        assert!(e.tick(h).is_empty(), "armed");
        let calls = h.calls.len();
        assert!(e.tick(h).is_empty(), "asked, not cut");
        assert_eq!(h.calls.len(), calls + 1);
        let b = body(h, calls);
        assert!(
            b.contains(r#""reason":"stalled""#) && b.ends_with(r#","recheck_ms":100}"#),
            "{b}"
        );
        h.calls[calls].0
    }

    /// Simulator seed 94448: a stall ask sent just before the worker stops for past the
    /// abort deadline. Its answer is lost with the stall; the ask goes again when the
    /// worker resumes (its deadline moved on by the stall), and a deferral keeps the
    /// stream.
    #[test]
    fn a_stall_ask_whose_answer_a_worker_stall_lost_is_asked_again() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100,"tick_ms":50"#);
        stream(&mut e, &mut h, 1);
        h.now += 100;
        assert!(e.on_host_tick(&mut h).is_empty(), "armed");
        assert!(e.on_host_tick(&mut h).is_empty(), "asked, not cut");
        assert_eq!(h.calls.len(), 1);
        // The worker does not run for 40 s.
        h.now += 40_000;
        assert!(e.on_host_tick(&mut h).is_empty(), "not cut on resuming");
        assert_eq!(h.metric(Metric::WorkerStalls), 1);
        for _ in 0..100 {
            if h.calls.len() > 1 {
                break;
            }
            h.now += 50;
            assert!(e.on_host_tick(&mut h).is_empty());
        }
        assert_eq!(h.calls.len(), 2, "asked again");
        assert!(
            body(&h, 1).contains(r#""recheck_ms":100"#),
            "{}",
            body(&h, 1)
        );
        let t = h.calls[1].0;
        e.on_abort_answer(&mut h, t, Some(200), DEFERRED);
        h.now += 50;
        assert!(e.on_host_tick(&mut h).is_empty(), "kept");
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Deferred)),
            1
        );
    }

    #[test]
    fn a_stall_kvguard_control_defers_keeps_the_stream_and_is_asked_again() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let t = stall_asked(&mut e, &mut h);
        // While the answer is awaited nothing is cut or asked again.
        for _ in 0..5 {
            h.now += 100;
            assert!(e.tick(&mut h).is_empty());
        }
        assert_eq!(h.calls.len(), 1);
        e.on_abort_answer(&mut h, t, Some(200), DEFERRED);
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Deferred)),
            1
        );
        assert!(h.logs.iter().any(|(_, m)| m.contains("outcome=deferred")));
        // Kept for one idle window from the answer, then asked again (still silent).
        h.now += 99;
        assert!(e.tick(&mut h).is_empty());
        assert_eq!(h.calls.len(), 1);
        h.now += 1;
        assert!(e.tick(&mut h).is_empty(), "armed");
        assert_eq!(h.calls.len(), 1);
        h.now += 10;
        assert!(e.tick(&mut h).is_empty());
        assert_eq!(h.calls.len(), 2, "asked again");
        assert!(body(&h, 1).contains(r#""idle_ms":710"#), "{}", body(&h, 1));
        // kvguard-control ends it this time: cut at the next tick, with no second abort.
        let t = h.calls[1].0;
        e.on_abort_answer(&mut h, t, Some(200), br#"{"found":true,"aborted":true}"#);
        h.now += 10;
        assert_eq!(e.tick(&mut h), stalled_cut(1));
        assert_eq!(
            e.on_log(&mut h, 1, b"wasm_fail_stream", flags::LR),
            Some(OutcomeTag::Aborted(AbortReason::Stalled))
        );
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 2);
        assert_eq!(e.pending_aborts(), 0);
    }

    #[test]
    fn progress_while_deferred_restarts_the_idle_clock() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let t = stall_asked(&mut e, &mut h);
        e.on_abort_answer(&mut h, t, Some(200), DEFERRED);
        // The client drained: a chunk passes 50 ms later.
        h.now += 50;
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.now += 60;
        assert!(e.tick(&mut h).is_empty());
        assert_eq!(h.calls.len(), 1, "idle 60 ms since the chunk: not due");
        h.now += 40;
        assert!(e.tick(&mut h).is_empty(), "due: armed");
        assert!(e.tick(&mut h).is_empty(), "asked");
        assert_eq!(h.calls.len(), 2);
        assert!(body(&h, 1).contains(r#""idle_ms":100"#), "{}", body(&h, 1));
    }

    #[test]
    fn a_stall_kvguard_control_does_not_defer_is_cut_at_the_next_tick() {
        // Ended, or not found (kvguard-control is not on its path): cut as without
        // kvguard-control.
        for (status, answer) in [(Some(404), &b""[..]), (Some(200), b"{}")] {
            let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
            stream(&mut e, &mut h, 1);
            let t = stall_asked(&mut e, &mut h);
            e.on_abort_answer(&mut h, t, status, answer);
            assert_eq!(e.tick(&mut h), stalled_cut(1), "{status:?}");
        }
        // No call possible (the host refuses it): cut at the next tick.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        h.now += 100;
        e.tick(&mut h);
        h.refuse = Some(crate::host::DispatchError::BadArgument);
        assert_eq!(e.tick(&mut h).len(), 0, "asked: the call is refused");
        assert_eq!(e.tick(&mut h).len(), 1, "cut at the next tick");
    }

    #[test]
    fn an_ask_that_got_no_answer_is_asked_again_as_it_was_and_the_stream_kept() {
        // A timeout, or a transient refusal (all of kvguard-control's admin slots busy):
        // no verdict. The stream stays open and the retry asks the same question, so
        // kvguard-control's deferral of it still keeps it.
        for status in [None, Some(503)] {
            let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
            stream(&mut e, &mut h, 1);
            let t = stall_asked(&mut e, &mut h);
            e.on_abort_answer(&mut h, t, status, b"");
            h.now += BACKOFF_MAX_MS;
            assert!(
                e.tick(&mut h).is_empty(),
                "{status:?}: kept while asked again"
            );
            let c = h.calls[1].clone();
            let b = String::from_utf8(c.3).unwrap();
            assert!(
                b.contains(r#""attempt":2"#) && b.ends_with(r#","recheck_ms":100}"#),
                "{b}"
            );
            e.on_abort_answer(&mut h, c.0, Some(200), DEFERRED);
            assert!(e.tick(&mut h).is_empty(), "{status:?}: deferred");
            assert_eq!(
                h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Deferred)),
                1
            );
            assert_eq!(
                h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Aborted)),
                0
            );
        }
    }

    #[test]
    fn an_ask_unanswered_until_the_deadline_is_cut_by_the_filters_own_judgement() {
        // kvguard-control unreachable: the ask is retried past `abort_retries` (0 here),
        // the stream kept, until the deadline; then the filter's idle verdict stands.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100,"abort_retries":0"#);
        stream(&mut e, &mut h, 1);
        let mut t = stall_asked(&mut e, &mut h);
        let asked_at = h.now;
        let mut cut_at = None;
        // Bounded: a queue that loses the job never cuts.
        for _ in 0..2 * DEADLINE_MS / BACKOFF_MAX_MS {
            e.on_abort_answer(&mut h, t, None, b"");
            h.now += BACKOFF_MAX_MS;
            let cut = e.tick(&mut h);
            if !cut.is_empty() {
                assert_eq!(cut, stalled_cut(1));
                cut_at = Some(h.now - asked_at);
                break;
            }
            t = h.calls.last().unwrap().0;
        }
        let cut_at = cut_at.expect("never cut");
        assert!(
            (DEADLINE_MS - BACKOFF_MAX_MS..=DEADLINE_MS + BACKOFF_MAX_MS).contains(&cut_at),
            "cut {cut_at} ms after the ask"
        );
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Failed)),
            1
        );
        assert!(h.calls.len() > 2, "asked again past abort_retries");
    }

    #[test]
    fn progress_after_the_arming_tick_disarms_it() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        h.now += 100;
        assert!(e.tick(&mut h).is_empty(), "armed");
        h.now += 50;
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        assert!(e.tick(&mut h).is_empty());
        // Due again 100 ms after that chunk: armed afresh, not asked.
        h.now += 100;
        assert!(e.tick(&mut h).is_empty());
        assert!(h.calls.is_empty(), "asked at the tick that found it due");
        h.now += 10;
        e.tick(&mut h);
        assert_eq!(h.calls.len(), 1);
        // The same when the chunk came while the clock could not be read (the tick
        // stamps it).
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        h.now += 100;
        assert!(e.tick(&mut h).is_empty(), "armed");
        h.stale = Some(h.now);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.stale = None;
        h.now += 50;
        assert!(e.tick(&mut h).is_empty());
        h.now += 100;
        assert!(e.tick(&mut h).is_empty());
        assert!(h.calls.is_empty(), "asked at the tick that found it due");
    }

    #[test]
    fn an_answered_stall_is_asked_again_after_observe_mode_not_cut() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let t = stall_asked(&mut e, &mut h);
        e.set_mode(&mut h, Mode::Observe);
        e.on_abort_answer(&mut h, t, Some(404), b"");
        assert_eq!(
            e.tick(&mut h),
            vec![Action::Mark {
                ctx: 1,
                tag: OutcomeTag::Observed(AbortReason::Stalled)
            }]
        );
        e.set_mode(&mut h, Mode::Enforce);
        // Its clocks start afresh: nothing is due, nothing is cut.
        assert!(e.tick(&mut h).is_empty());
        h.now += 50;
        assert!(e.tick(&mut h).is_empty());
    }

    /// kvguard-control's end of a stream it ends: its final event, then the end.
    const ENDED_HERE: &[u8] = b"event: error\ndata: {\"error\":{\"type\":\"kvguard_aborted\"}}\n\n";

    #[test]
    fn an_end_that_passes_before_the_answer_is_held_and_the_stream_cut() {
        // kvguard-control ends the stream (its final event and the end) before its answer
        // arrives: the end is held, the next tick cuts the stream, with no second abort.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let t = stall_asked(&mut e, &mut h);
        assert_eq!(
            e.on_response_body(&mut h, 1, ENDED_HERE, 0, true),
            Some(OutcomeTag::Aborted(AbortReason::Stalled)),
            "held"
        );
        assert_eq!(e.tick(&mut h), stalled_cut(1));
        e.on_abort_answer(&mut h, t, Some(200), br#"{"found":true,"aborted":true}"#);
        assert_eq!(
            e.on_log(&mut h, 1, b"wasm_fail_stream", flags::LR),
            Some(OutcomeTag::Aborted(AbortReason::Stalled))
        );
        assert_eq!(h.calls.len(), 1);
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Aborted)),
            1
        );
        // The same when the answer (no deferral) came first and the end before the tick;
        // and for trailers, or a chunk the host could not hand over.
        for end in 0..3 {
            let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
            stream(&mut e, &mut h, 1);
            let t = stall_asked(&mut e, &mut h);
            e.on_abort_answer(&mut h, t, Some(404), b"");
            let held = match end {
                0 => e.on_response_body(&mut h, 1, ENDED_HERE, 0, true).is_some(),
                1 => e.on_response_trailers(1),
                _ => e.on_chunk(&mut h, 1, 5, true, || None).is_some(),
            };
            assert!(held, "end {end}");
            assert_eq!(e.tick(&mut h), stalled_cut(1), "end {end}");
        }
    }

    #[test]
    fn an_end_is_not_held_once_deferred_nor_when_the_body_completed_nor_unasked() {
        // Deferred: the reader drains; the end reaches it.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let t = stall_asked(&mut e, &mut h);
        e.on_abort_answer(&mut h, t, Some(200), DEFERRED);
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, true),
            None
        );
        assert!(e.tick(&mut h).is_empty());
        // The engine finished (the body completed) while the answer was awaited.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        stall_asked(&mut e, &mut h);
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, true),
            Some(OutcomeTag::Completed)
        );
        assert!(e.tick(&mut h).is_empty());
        // Never asked; or observe mode.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        assert_eq!(e.on_response_body(&mut h, 1, ENDED_HERE, 0, true), None);
        assert!(!e.on_response_trailers(1));
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        stall_asked(&mut e, &mut h);
        e.set_mode(&mut h, Mode::Observe);
        assert_eq!(e.on_response_body(&mut h, 1, ENDED_HERE, 0, true), None);
    }

    #[test]
    fn a_stall_the_queue_has_no_room_to_ask_about_is_cut_at_once() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100,"max_pending_aborts":1"#);
        track(&mut e, &mut h, 9, "gone");
        e.on_log(&mut h, 9, b"downstream_remote_disconnect", flags::DC);
        stream(&mut e, &mut h, 1);
        h.now += 100;
        e.tick(&mut h);
        assert_eq!(e.tick(&mut h), stalled_cut(1));
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Dropped)),
            1
        );
    }

    #[test]
    fn kill_switch_reaches_streams_in_flight_and_enforce_restarts_clocks() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        // Observe pushed while the stream is in flight: its stall is only observed.
        e.set_mode(&mut h, Mode::Observe);
        h.now += 100;
        assert_eq!(
            confirmed_tick(&mut e, &mut h),
            vec![Action::Mark {
                ctx: 1,
                tag: OutcomeTag::Observed(AbortReason::Stalled)
            }]
        );
        assert!(h.calls.is_empty());
        // A disconnect in observe mode sends nothing either.
        stream(&mut e, &mut h, 2);
        assert_eq!(
            e.on_log(&mut h, 2, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Observed(AbortReason::DownstreamReset))
        );
        e.pump(&mut h);
        assert!(h.calls.is_empty());
        // Back to enforce: the flagged stream gets a fresh idle window, not a close now.
        h.now += 1000;
        e.set_mode(&mut h, Mode::Enforce);
        assert!(e.tick(&mut h).is_empty());
        h.now += 99;
        assert!(e.tick(&mut h).is_empty());
        h.now += 1;
        assert_eq!(confirmed_tick(&mut e, &mut h), stalled_cut(1));
        // Enforce again for on_log too.
        stream(&mut e, &mut h, 3);
        assert_eq!(
            e.on_log(&mut h, 3, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        assert!(h
            .logs
            .iter()
            .any(|(_, m)| m.starts_with("mode is now observe")));
    }

    #[test]
    fn mass_stall_is_held_one_window_then_closed_if_still_idle() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        for ctx in 1..=20 {
            stream(&mut e, &mut h, ctx);
        }
        // An engine-wide pause: all 20 go idle at once; 8 (= max(8, 20 % of 20)) close,
        // the other 12 wait one more idle window.
        h.now += 100;
        let closed = confirmed_tick(&mut e, &mut h);
        assert_eq!(closed.len(), 8, "max(8, 20 % of 20) close at once");
        assert_eq!(h.metric(Metric::StallHolds), 12);
        let warns = |h: &MockHost| {
            h.logs
                .iter()
                .filter(|(l, m)| *l == Level::Warn && m.starts_with("mass stall"))
                .count()
        };
        assert_eq!(warns(&h), 1);
        let held: Vec<u32> = (1..=20)
            .filter(|c| {
                !closed
                    .iter()
                    .any(|a| matches!(a, Action::Close { ctx, .. } if ctx == c))
            })
            .collect();
        // The pause ends for half of the held streams.
        h.now += 50;
        for &ctx in &held[..6] {
            e.on_response_body(&mut h, ctx, b"data: {}\n\n", 0, false);
        }
        h.now += 49;
        assert!(e.tick(&mut h).is_empty());
        assert_eq!(warns(&h), 1, "logged once");
        h.now += 1;
        let late = ended(&mut e, &mut h);
        let mut late_ctx: Vec<u32> = late
            .iter()
            .map(|a| match a {
                Action::Close { ctx, .. } | Action::Mark { ctx, .. } => *ctx,
            })
            .collect();
        late_ctx.sort_unstable();
        assert_eq!(late_ctx, held[6..].to_vec(), "what is still idle closes");
        assert_eq!(h.metric(Metric::StallHolds), 12, "held once only");
    }

    /// 20 streams; half go quiet at once, the other half 10 ms later (after a tick: their
    /// chunks then read the clock); the clock then stands where the first half's idle
    /// timeout (100 ms) runs out.
    fn stall_in_two_halves(e: &mut Engine, h: &mut MockHost) {
        for ctx in 1..=20 {
            stream(e, h, ctx);
        }
        h.now += 10;
        assert!(e.tick(h).is_empty());
        for ctx in 11..=20 {
            e.on_response_body(h, ctx, b"data: {}\n\n", 0, false);
        }
        h.now += 90;
    }

    #[test]
    fn stalls_spread_over_ticks_within_one_window_add_up() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stall_in_two_halves(&mut e, &mut h);
        assert_eq!(
            confirmed_tick(&mut e, &mut h).len(),
            8,
            "max(8, 20 % of 20) close"
        );
        h.now += 10;
        assert!(
            confirmed_tick(&mut e, &mut h).is_empty(),
            "the stalls of the window's earlier ticks still count"
        );
        assert_eq!(h.metric(Metric::StallHolds), 12);
    }

    #[test]
    fn each_mass_stall_is_reported_once() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        let reports = |h: &MockHost| {
            h.logs
                .iter()
                .filter(|(_, m)| m.starts_with("mass stall"))
                .count()
        };
        stall_in_two_halves(&mut e, &mut h);
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 8);
        // A tick that holds nothing within the episode does not end it...
        h.now += 5;
        assert!(e.tick(&mut h).is_empty());
        h.now += 5;
        assert!(confirmed_tick(&mut e, &mut h).is_empty());
        assert_eq!(h.metric(Metric::StallHolds), 12);
        assert_eq!(reports(&h), 1, "one episode, one report");
        // ...a window without stalls does: the next mass stall is reported again.
        for ctx in 1..=20 {
            e.forget(&mut h, ctx);
        }
        h.now += 200;
        assert!(e.tick(&mut h).is_empty());
        for ctx in 21..=40 {
            stream(&mut e, &mut h, ctx);
        }
        h.now += 100;
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 8);
        assert_eq!(reports(&h), 2);
    }

    /// Issue 27.7: first-token timeouts are idleness too: held by the valve like stalls
    /// (an engine that stops scheduling starves every queued request at once).
    #[test]
    fn first_token_timeouts_count_toward_a_mass_stall() {
        let (mut e, mut h) = engine(r#","first_token_timeout_ms":100"#);
        for ctx in 1..=20 {
            track(&mut e, &mut h, ctx, &format!("f{ctx}"));
            sse(&mut e, &mut h, ctx);
        }
        h.now += 100;
        let closed = confirmed_tick(&mut e, &mut h);
        assert_eq!(closed.len(), 8, "max(8, 20 % of 20) close at once");
        assert!(closed.iter().all(|a| matches!(
            a,
            Action::Close {
                tag: OutcomeTag::Aborted(AbortReason::FirstTokenTimeout),
                ..
            }
        )));
        assert_eq!(h.metric(Metric::StallHolds), 12);
        // Held one more window of their own clock, then closed if still waiting.
        h.now += 99;
        assert!(e.tick(&mut h).is_empty());
        h.now += 1;
        assert_eq!(e.tick(&mut h).len(), 12);
    }

    /// Issue 27.7: the valve counts only streams whose idle clock runs: many tracked
    /// requests that cannot stall (no first-token clock, nothing streamed yet) do not
    /// raise the threshold, so a mass stall among the streaming ones is still held.
    #[test]
    fn cheap_tracked_requests_do_not_inflate_the_valve() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        for ctx in 1..=20 {
            stream(&mut e, &mut h, ctx);
        }
        for ctx in 100..600 {
            track(&mut e, &mut h, ctx, &format!("q{ctx}"));
        }
        h.now += 100;
        // 520 tracked would allow 104 stalls; the 20 streaming ones allow 8.
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 8);
        assert_eq!(h.metric(Metric::StallHolds), 12);
    }

    /// Observe mode holds nothing (it cuts nothing): every idle stream is marked at once.
    #[test]
    fn observe_mode_is_not_held_by_the_valve() {
        let (mut e, mut h) = engine(r#","mode":"observe","idle_timeout_ms":100"#);
        for ctx in 1..=20 {
            stream(&mut e, &mut h, ctx);
        }
        h.now += 100;
        let marked = confirmed_tick(&mut e, &mut h);
        assert_eq!(marked.len(), 20);
        assert!(marked.iter().all(|a| matches!(a, Action::Mark { .. })));
        assert_eq!(h.metric(Metric::StallHolds), 0);
    }

    #[test]
    fn a_few_stalls_close_at_once() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        for ctx in 1..=8 {
            stream(&mut e, &mut h, ctx);
        }
        h.now += 100;
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 8);
        assert_eq!(h.metric(Metric::StallHolds), 0);
        assert!(
            !h.logs.iter().any(|(_, m)| m.starts_with("mass stall")),
            "no mass stall is reported"
        );
    }

    #[test]
    fn twenty_percent_stalling_one_by_one_is_no_mass_stall() {
        // 40 healthy streams and 10 that stall 37 ms apart, each closed (and gone from the
        // table) before the next comes due: 10 of 50 is not more than 20 %.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":1000"#);
        for ctx in 1..=50 {
            stream(&mut e, &mut h, ctx);
        }
        for j in 1..=10 {
            h.now += 37;
            for ctx in (j + 1)..=50 {
                e.on_response_body(&mut h, ctx, b"data: {}\n\n", 0, false);
            }
        }
        let mut stalls = 0;
        for _ in 0..60 {
            h.now += 37;
            for ctx in 11..=50 {
                e.on_response_body(&mut h, ctx, b"data: {}\n\n", 0, false);
            }
            for act in ended(&mut e, &mut h) {
                if let Action::Close { ctx, tag } = act {
                    assert_eq!(tag, OutcomeTag::Aborted(AbortReason::Stalled));
                    assert!(ctx <= 10, "a healthy stream was closed");
                    stalls += 1;
                    e.on_log(&mut h, ctx, b"wasm_fail_stream", flags::LR);
                }
            }
        }
        assert_eq!(stalls, 10);
        assert_eq!(h.metric(Metric::StallHolds), 0);
    }

    #[test]
    fn unreadable_chunks_are_progress_and_host_errors() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        h.now += 90;
        assert_eq!(e.on_chunk(&mut h, 1, 7, false, || None), None);
        h.now += 20;
        assert!(
            e.tick(&mut h).is_empty(),
            "no stall after an unreadable chunk"
        );
        assert_eq!(h.metric(Metric::HostErrors), 1);
    }

    #[test]
    fn a_chunk_is_read_only_when_its_bytes_are_scanned() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        let reads = std::cell::Cell::new(0);
        let read = |b: &'static [u8]| {
            let reads = &reads;
            move || {
                reads.set(reads.get() + 1);
                Some(b.to_vec())
            }
        };
        stream(&mut e, &mut h, 1);
        // A chunk with no bytes (an end of stream alone, say) is not read.
        assert_eq!(e.on_chunk(&mut h, 1, 0, false, read(b"")), None);
        assert_eq!(reads.get(), 0);
        // A chunk the host cannot hand over is progress and a host error.
        h.now += 90;
        assert_eq!(e.on_chunk(&mut h, 1, 5, false, || None), None);
        assert_eq!(h.metric(Metric::HostErrors), 1);
        h.now += 20;
        assert!(
            e.tick(&mut h).is_empty(),
            "no stall after an unreadable chunk"
        );
        // A chunk with bytes is read and scanned.
        let done = b"data: [DONE]\n\n";
        assert_eq!(
            e.on_chunk(&mut h, 1, done.len(), false, read(done)),
            Some(OutcomeTag::Completed)
        );
        assert_eq!(reads.get(), 1);
        // An opaque body's chunks are counted, never read.
        track(&mut e, &mut h, 2, "o2");
        assert_eq!(
            e.on_response_headers(
                &mut h,
                2,
                Some(b"application/octet-stream"),
                None,
                None,
                false
            ),
            BodyNeed::Length
        );
        e.on_chunk(&mut h, 2, 10, false, read(b"0123456789"));
        // Nor are an untracked stream's.
        assert_eq!(e.on_chunk(&mut h, 9, done.len(), false, read(done)), None);
        assert_eq!(reads.get(), 1);
    }

    #[test]
    fn a_chunk_without_anomalies_makes_no_metric_call() {
        let (mut e, mut h) = engine("");
        stream(&mut e, &mut h, 1);
        let before = h.adds;
        e.on_response_body(&mut h, 1, b"data: {}\n\ndata: {}\n\n", 0, false);
        assert_eq!(h.adds, before, "anomaly counters are host calls");
    }

    #[test]
    fn trailers_end_a_stream_without_done() {
        let (mut e, mut h) = engine("");
        stream(&mut e, &mut h, 1);
        e.on_response_trailers(1);
        assert_eq!(e.body_need(1), BodyNeed::Nothing);
        assert_eq!(
            e.on_log(&mut h, 1, b"via_upstream", 0),
            Some(OutcomeTag::Completed)
        );
        e.pump(&mut h);
        assert!(h.calls.is_empty());
    }

    #[test]
    fn interleaved_choices_complete_only_at_done() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "n2");
        sse(&mut e, &mut h, 1);
        for ev in [
            &br#"data: {"choices":[{"index":0,"finish_reason":"stop"}]}"#[..],
            br#"data: {"choices":[{"index":1,"delta":{"content":"late"},"finish_reason":null}]}"#,
        ] {
            assert_eq!(
                e.on_response_body(&mut h, 1, &[ev, b"\n\n"].concat(), 0, false),
                None
            );
        }
        assert_eq!(e.body_need(1), BodyNeed::Bytes, "index 1 still streams");
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false),
            Some(OutcomeTag::Completed)
        );
    }

    #[test]
    fn max_age_is_off_by_default() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":0"#);
        stream(&mut e, &mut h, 1);
        h.now += 86_400_000;
        assert!(e.tick(&mut h).is_empty());
    }

    #[derive(Default)]
    struct FakeStreams {
        log: Vec<String>,
        refuse_select: Option<u32>,
        refuse_close: Option<u32>,
        selected: u32,
    }

    impl Streams for FakeStreams {
        fn select(&mut self, ctx: u32) -> bool {
            self.log.push(format!("select {ctx}"));
            self.selected = ctx;
            self.refuse_select != Some(ctx)
        }
        fn set_outcome(&mut self, tag: OutcomeTag) {
            self.log.push(tag.as_string());
        }
        fn close(&mut self) -> bool {
            self.log.push("close".into());
            self.refuse_close != Some(self.selected)
        }
        fn restore(&mut self) {
            self.log.push("restore".into());
        }
    }

    #[test]
    fn apply_marks_closes_and_restores() {
        let mut s = FakeStreams {
            refuse_select: Some(3),
            ..FakeStreams::default()
        };
        let done = apply(
            &[
                Action::Close {
                    ctx: 1,
                    tag: OutcomeTag::Aborted(AbortReason::Stalled),
                },
                Action::Mark {
                    ctx: 2,
                    tag: OutcomeTag::Observed(AbortReason::MaxAge),
                },
                Action::Close {
                    ctx: 3,
                    tag: OutcomeTag::Aborted(AbortReason::Stalled),
                },
            ],
            &mut s,
        );
        assert_eq!(
            done,
            Applied {
                closed: 1,
                failed: 1
            }
        );
        assert_eq!(
            s.log,
            [
                "select 1",
                "aborted:stalled",
                "close",
                "select 2",
                "observed:max_age",
                "select 3",
                "restore"
            ]
        );
        let mut s = FakeStreams::default();
        assert_eq!(apply(&[], &mut s), Applied::default());
        assert!(s.log.is_empty());
    }

    #[test]
    fn a_close_the_host_refuses_counts_as_failed() {
        let mut s = FakeStreams {
            refuse_close: Some(2),
            ..FakeStreams::default()
        };
        let close = |ctx| Action::Close {
            ctx,
            tag: OutcomeTag::Aborted(AbortReason::Stalled),
        };
        let done = apply(&[close(1), close(2), close(3)], &mut s);
        assert_eq!(
            done,
            Applied {
                closed: 2,
                failed: 1
            }
        );
    }

    #[test]
    fn an_observed_request_s_histograms_are_labelled_observed() {
        let (mut e, mut h) = engine(r#","mode":"observe","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "o1");
        sse(&mut e, &mut h, 1);
        e.on_response_body(&mut h, 1, b"data: {}\n\n", 0, false);
        h.now += 100;
        assert_eq!(confirmed_tick(&mut e, &mut h).len(), 1);
        e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false);
        e.on_log(&mut h, 1, b"via_upstream", 0);
        assert_eq!(
            h.observed(Metric::StreamDurationMs(Ended::Observed)),
            vec![100]
        );
        assert!(h
            .observed(Metric::StreamDurationMs(Ended::Completed))
            .is_empty());
    }

    #[test]
    fn reconfiguring_applies_the_new_mode_and_abort_bound() {
        let (mut e, mut h) = engine("");
        e.reconfigure(&mut h, config(r#","max_pending_aborts":1"#));
        for ctx in 1..=2 {
            track(&mut e, &mut h, ctx, &format!("d{ctx}"));
            e.on_log(&mut h, ctx, b"downstream_remote_disconnect", flags::DC);
        }
        assert_eq!(e.pending_aborts(), 1);
        assert_eq!(
            h.metric(Metric::Aborts(
                AbortReason::DownstreamReset,
                Outcome::Dropped
            )),
            1
        );
        e.reconfigure(&mut h, config(r#","mode":"observe""#));
        assert_eq!(e.mode(), Mode::Observe);
        track(&mut e, &mut h, 3, "o3");
        assert_eq!(
            e.on_log(&mut h, 3, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Observed(AbortReason::DownstreamReset))
        );
    }

    /// The reason in the abort body of call `i`.
    fn reason_of(h: &MockHost, i: usize) -> String {
        let v: serde_json::Value = serde_json::from_slice(&h.calls[i].3).unwrap();
        v["reason"].as_str().unwrap().to_owned()
    }

    /// Issue 10.2: a local reply (Envoy's or another filter's) ends the client's stream
    /// after the request reached an upstream; the details name nothing (a wasm filter's
    /// `send_http_response` logs `""` and no flag, as Envoy 1.40 shows). Aborted as
    /// `local_reply` however far the filter saw the response.
    #[test]
    fn a_local_reply_after_the_upstream_was_reached_aborts() {
        let (mut e, mut h) = engine("");
        h.upstream = true;
        // A non-streaming request: the engine sends its headers with the whole body, so a
        // local reply while it generates goes through the filter chain, and the filter
        // sees that reply's headers and end of stream (the path that used to complete).
        track(&mut e, &mut h, 1, "j1");
        assert_eq!(
            e.on_response_headers(&mut h, 1, Some(b"text/plain"), None, None, false),
            BodyNeed::Length
        );
        e.on_response_body(&mut h, 1, &[], 27, true);
        assert!(e.end_details_needed(1));
        assert_eq!(
            e.on_log(&mut h, 1, b"", 0),
            Some(OutcomeTag::Aborted(AbortReason::LocalReply))
        );
        // SSE after the upstream's headers and a few events: Envoy sends the reply
        // straight to the codec, so the filter sees no end of stream.
        stream(&mut e, &mut h, 2);
        assert_eq!(
            e.on_log(&mut h, 2, b"", 0),
            Some(OutcomeTag::Aborted(AbortReason::LocalReply))
        );
        // A filter nearer the upstream answered in its response-headers callback: this
        // filter saw nothing of the response.
        track(&mut e, &mut h, 3, "r3");
        assert_eq!(
            e.on_log(&mut h, 3, b"", 0),
            Some(OutcomeTag::Aborted(AbortReason::LocalReply))
        );
        // Envoy's own: a buffering filter past its limit (Lua's body(), ext_proc buffered).
        stream(&mut e, &mut h, 4);
        assert_eq!(
            e.on_log(&mut h, 4, b"response_payload_too_large", 0),
            Some(OutcomeTag::Aborted(AbortReason::LocalReply))
        );
        // ext_proc's immediate_response in the response phase.
        stream(&mut e, &mut h, 5);
        assert_eq!(
            e.on_log(&mut h, 5, b"ext_proc_immediate_response", 0),
            Some(OutcomeTag::Aborted(AbortReason::LocalReply))
        );
        assert_eq!(h.upstream_asked, 5);
        assert_eq!(h.metric(Metric::RequestsCompleted), 0);
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 5);
        for i in 0..5 {
            assert_eq!(reason_of(&h, i), "local_reply", "{}", body(&h, i));
        }
        // Observe mode only counts it.
        e.set_mode(&mut h, Mode::Observe);
        stream(&mut e, &mut h, 6);
        assert_eq!(
            e.on_log(&mut h, 6, b"", 0),
            Some(OutcomeTag::Observed(AbortReason::LocalReply))
        );
        assert_eq!(h.metric(Metric::WouldAbort(AbortReason::LocalReply)), 1);
        e.pump(&mut h);
        assert_eq!(h.calls.len(), 5);
    }

    /// The same unnamed ends without an upstream (a filter or the router answered before
    /// any, a `direct_response`): settled as before.
    #[test]
    fn unnamed_ends_without_an_upstream_settle_as_before() {
        let (mut e, mut h) = engine("");
        h.upstream = false;
        track(&mut e, &mut h, 1, "n1");
        e.on_response_headers(&mut h, 1, Some(b"text/plain"), None, None, false);
        e.on_response_body(&mut h, 1, &[], 27, true);
        assert_eq!(e.on_log(&mut h, 1, b"", 0), Some(OutcomeTag::Completed));
        track(&mut e, &mut h, 2, "n2");
        e.on_response_headers(&mut h, 2, Some(b"text/plain"), None, None, true);
        assert_eq!(
            e.on_log(&mut h, 2, b"direct_response", 0),
            Some(OutcomeTag::Completed)
        );
        // No end of stream at all: the client's stream went away.
        track(&mut e, &mut h, 3, "n3");
        assert_eq!(
            e.on_log(&mut h, 3, b"", 0),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        assert_eq!(h.upstream_asked, 3);
        assert_eq!(h.metric(Metric::RequestsCompleted), 2);
    }

    /// Ends that the body, the details or the flags name are settled as before, and never
    /// cost the upstream question: a healthy stream's end reads nothing more.
    #[test]
    fn named_ends_never_ask_for_the_upstream() {
        let (mut e, mut h) = engine("");
        h.upstream = true;
        // SSE to [DONE]: not even the end details are read.
        track(&mut e, &mut h, 1, "h1");
        sse(&mut e, &mut h, 1);
        assert_eq!(
            e.on_response_body(&mut h, 1, b"data: [DONE]\n\n", 0, false),
            Some(OutcomeTag::Completed)
        );
        assert!(!e.end_details_needed(1));
        assert_eq!(e.on_log(&mut h, 1, b"", 0), None);
        // JSON to the upstream's end of stream.
        track(&mut e, &mut h, 2, "h2");
        e.on_response_headers(&mut h, 2, Some(b"application/json"), None, None, false);
        e.on_response_body(&mut h, 2, &[], 300, true);
        assert_eq!(
            e.on_log(&mut h, 2, b"via_upstream", 0),
            Some(OutcomeTag::Completed)
        );
        // SSE ended by the upstream without [DONE] (trailers).
        stream(&mut e, &mut h, 3);
        e.on_response_trailers(3);
        assert_eq!(
            e.on_log(&mut h, 3, b"via_upstream", 0),
            Some(OutcomeTag::Completed)
        );
        // The client left (HTTP/1.1, HTTP/2): downstream_reset as before.
        stream(&mut e, &mut h, 4);
        assert_eq!(
            e.on_log(&mut h, 4, b"downstream_remote_disconnect", flags::DC),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        stream(&mut e, &mut h, 5);
        assert_eq!(
            e.on_log(&mut h, 5, b"http2.remote_reset", flags::DR),
            Some(OutcomeTag::Aborted(AbortReason::DownstreamReset))
        );
        // Envoy's timeout reply and an upstream reset.
        track(&mut e, &mut h, 6, "h6");
        e.on_response_headers(&mut h, 6, Some(b"text/plain"), None, None, false);
        e.on_response_body(&mut h, 6, &[], 24, true);
        assert_eq!(
            e.on_log(&mut h, 6, b"response_timeout", flags::UT),
            Some(OutcomeTag::Aborted(AbortReason::Timeout))
        );
        stream(&mut e, &mut h, 7);
        assert_eq!(
            e.on_log(
                &mut h,
                7,
                b"upstream_reset_after_response_started{protocol_error}",
                flags::UPE
            ),
            Some(OutcomeTag::Aborted(AbortReason::UpstreamReset))
        );
        assert_eq!(h.upstream_asked, 0);
        assert_eq!(h.metric(Metric::RequestsCompleted), 3);
    }

    /// Issue 27.2: a Responses API stream that sent its preamble and then waits in the
    /// engine's queue longer than the idle timeout (KV pressure) is not cut: idleness
    /// runs from the first content.
    #[test]
    fn a_preamble_then_a_long_queue_is_no_stall() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        track(&mut e, &mut h, 1, "q1");
        sse(&mut e, &mut h, 1);
        let preamble = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\n\
            event: response.in_progress\ndata: {\"type\":\"response.in_progress\"}\n\n";
        e.on_response_body(&mut h, 1, preamble, 0, false);
        h.now += 5_000;
        assert!(
            confirmed_tick(&mut e, &mut h).is_empty(),
            "queued, not stalled"
        );
        let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n";
        e.on_response_body(&mut h, 1, delta, 0, false);
        h.now += 99;
        assert!(confirmed_tick(&mut e, &mut h).is_empty());
        h.now += 1;
        assert_eq!(
            confirmed_tick(&mut e, &mut h).len(),
            1,
            "then idle from the content"
        );
        e.on_log(&mut h, 1, b"", 0);
        assert_eq!(
            h.observed(Metric::FirstTokenMs(Ended::Aborted)),
            vec![5_000]
        );
    }

    /// Issue 27.3: heartbeats from a stuck engine do not keep a dead stream alive.
    #[test]
    fn heartbeats_do_not_keep_a_dead_stream_alive() {
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 1);
        let mut cut = Vec::new();
        for _ in 0..10 {
            h.now += 30;
            e.on_response_body(
                &mut h,
                1,
                b"event: ping\ndata: {}\n\ndata: {\"type\":\"ping\"}\n\n",
                0,
                false,
            );
            cut.extend(ended(&mut e, &mut h));
        }
        assert_eq!(cut, stalled_cut(1));
        // With an empty list every event is progress, as before.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100,"non_progress_events":[]"#);
        stream(&mut e, &mut h, 1);
        for _ in 0..10 {
            h.now += 30;
            e.on_response_body(&mut h, 1, b"event: ping\ndata: {}\n\n", 0, false);
            assert!(e.tick(&mut h).is_empty());
        }
    }

    /// Issue 27.4: a request whose headers came while the clock could not be read (the
    /// fallback was 0: every request looked days old) fires nothing at once; a chunk read
    /// under a stale clock is not stamped earlier than it arrived; a tick without a
    /// clock decides nothing.
    #[test]
    fn a_clock_that_cannot_be_read_never_cuts_early() {
        let (mut e, mut h) =
            engine(r#","idle_timeout_ms":100,"first_token_timeout_ms":500,"max_age_ms":1000"#);
        h.now = 5_000_000;
        h.stale = Some(0);
        track(&mut e, &mut h, 1, "c1");
        sse(&mut e, &mut h, 1);
        h.stale = None;
        assert!(confirmed_tick(&mut e, &mut h).is_empty(), "not days old");
        h.now += 499;
        assert!(confirmed_tick(&mut e, &mut h).is_empty());
        h.now += 1;
        assert_eq!(
            confirmed_tick(&mut e, &mut h),
            vec![Action::Close {
                ctx: 1,
                tag: OutcomeTag::Aborted(AbortReason::FirstTokenTimeout)
            }]
        );
        // A chunk after a quiet tick reads the clock; a stale reading is not used.
        let (mut e, mut h) = engine(r#","idle_timeout_ms":100"#);
        stream(&mut e, &mut h, 2);
        h.now += 50;
        assert!(e.tick(&mut h).is_empty());
        h.now += 40;
        h.stale = Some(1_000);
        e.on_response_body(&mut h, 2, b"data: {}\n\n", 0, false);
        // No clock at this tick: nothing is stamped or decided.
        h.now += 100;
        assert!(e.tick(&mut h).is_empty());
        h.stale = None;
        // The chunk is stamped now (later than it came, never earlier).
        h.now += 10;
        assert!(confirmed_tick(&mut e, &mut h).is_empty());
        assert_eq!(e.request(2).and_then(Request::last_event_ms), Some(h.now));
    }

    /// Issue 27.9: the first-token clock counts from the end of the request body, so a
    /// slow upload does not use it up.
    #[test]
    fn the_first_token_clock_starts_when_the_upload_ends() {
        let (mut e, mut h) = engine(r#","first_token_timeout_ms":200"#);
        assert_eq!(
            e.on_request_headers(&mut h, 1, Some(b"/v1/chat/completions"), Some(b"u1"), true),
            Verdict::Tracked
        );
        // Headers only: counts from them.
        track(&mut e, &mut h, 2, "u2");
        h.now += 10_000;
        assert_eq!(
            confirmed_tick(&mut e, &mut h),
            vec![Action::Close {
                ctx: 2,
                tag: OutcomeTag::Aborted(AbortReason::FirstTokenTimeout)
            }],
            "a 10 s upload is not a first-token timeout"
        );
        e.on_request_end(&mut h, 1);
        h.now += 199;
        assert!(confirmed_tick(&mut e, &mut h).is_empty());
        h.now += 1;
        assert_eq!(
            confirmed_tick(&mut e, &mut h),
            vec![Action::Close {
                ctx: 1,
                tag: OutcomeTag::Aborted(AbortReason::FirstTokenTimeout)
            }]
        );
    }

    /// Issue 27.10: a reconfiguration with another `tick_ms` re-arms the tick.
    #[test]
    fn reconfiguring_tick_ms_re_arms_the_tick() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "t1");
        assert_eq!(e.tick_change(), Some(250));
        e.reconfigure(&mut h, config(r#","tick_ms":50"#));
        assert_eq!(e.tick_change(), Some(50));
        assert_eq!(e.tick_change(), None);
        e.reconfigure(&mut h, config(r#","tick_ms":50"#));
        assert_eq!(e.tick_change(), None);
        // Refused: the period before stays, and is asked again.
        e.reconfigure(&mut h, config(r#","tick_ms":20"#));
        assert_eq!(e.tick_change(), Some(20));
        e.tick_refused();
        assert_eq!(e.tick_change(), Some(20));
    }

    #[test]
    fn forget_is_a_safety_net() {
        let (mut e, mut h) = engine("");
        track(&mut e, &mut h, 1, "g1");
        e.forget(&mut h, 1);
        e.forget(&mut h, 1);
        assert_eq!(h.metric(Metric::ActiveRequests), 0);
        assert_eq!(e.on_log(&mut h, 1, b"", 0), None);
    }
}
