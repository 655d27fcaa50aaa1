//! The abort queue: bounded, bounded concurrency, retries with exponential backoff and
//! jitter for transient answers only, a per-call timeout and an overall deadline.

use crate::config::Config;
use crate::host::{Call, DispatchError, Host, Level};
use crate::metrics::{Metric, Metrics, Outcome, Route};
use kvguard_contract::{signature, AbortReason, AbortRequest, Disposition, Domain, RequestId};
use std::collections::VecDeque;
use std::net::SocketAddr;

/// Most abort calls in flight per VM.
pub const MAX_IN_FLIGHT: usize = 32;
/// First retry delay, ms (doubles each retry).
pub const BACKOFF_BASE_MS: u64 = 200;
/// Longest retry delay, ms.
pub const BACKOFF_MAX_MS: u64 = 5_000;
/// An abort not settled this long after it was queued is given up (`failed`), ms.
pub const DEADLINE_MS: u64 = 30_000;

/// How long past its own timeout (`abort_timeout_ms`, after which the host answers a
/// call with a timeout) a call may stay unanswered before the watchdog frees its slot.
pub const WATCHDOG_SLACK_MS: u64 = 1_000;

/// The header naming the replica for an ORIGINAL_DST cluster.
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";

/// One abort to deliver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The request to end.
    pub id: RequestId,
    /// Why.
    pub reason: AbortReason,
    /// Its age when decided.
    pub age_ms: u64,
    /// Data events seen (the body's `tokens`).
    pub events: u64,
    /// The stamped replica, when verified.
    pub target: Option<SocketAddr>,
    /// Calls made so far.
    pub attempts: u32,
    /// When the filter last saw a data event for the request (host clock, ms).
    pub last_event_ms: Option<u64>,
    /// When the client went away (the stream ended before the response did), ms; `None`
    /// while the client was connected when the abort was decided (a clock fired).
    pub gone_at_ms: Option<u64>,
    /// The stream (context id) kept open until this abort's first answer, and its idle
    /// window: the call allows a deferral (`recheck_ms`, contract §3) and its first
    /// answer is reported back ([`AbortQueue::take_asks`]). A call that got no answer (a
    /// timeout, a transient status, a lost answer, a refused dispatch) reports nothing:
    /// its retries ask the same, until an answer or the deadline. `None` once reported.
    pub ask: Option<(u32, u32)>,
    queued_ms: u64,
    /// [`DEADLINE_MS`] after it was decided, moved on by this worker's own stalls.
    deadline_ms: u64,
    next_ms: u64,
    /// When its current call was dispatched (for the watchdog).
    sent_ms: u64,
}

impl Job {
    /// When it was decided (host clock, ms).
    pub fn queued_ms(&self) -> u64 {
        self.queued_ms
    }

    /// A new job decided at `now_ms`.
    pub fn new(
        id: RequestId,
        reason: AbortReason,
        age_ms: u64,
        events: u64,
        target: Option<SocketAddr>,
        now_ms: u64,
    ) -> Self {
        Job {
            id,
            reason,
            age_ms,
            events,
            target,
            attempts: 0,
            last_event_ms: None,
            gone_at_ms: None,
            ask: None,
            queued_ms: now_ms,
            deadline_ms: now_ms.saturating_add(DEADLINE_MS),
            next_ms: now_ms,
            sent_ms: now_ms,
        }
    }

    /// The same job with the times `idle_ms` and `gone_ms` of each attempt count from.
    pub fn with_times(mut self, last_event_ms: Option<u64>, gone_at_ms: Option<u64>) -> Self {
        self.last_event_ms = last_event_ms;
        self.gone_at_ms = gone_at_ms;
        self
    }
}

/// An abort that reached its final outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The job.
    pub job: Job,
    /// How it ended.
    pub outcome: Outcome,
    /// The last HTTP status, if any.
    pub status: Option<u16>,
}

/// Whether `hay` contains `needle` (short answers: a plain scan keeps the module small).
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The first answer to an abort that asked ([`Job::ask`]): the stream kept open for it
/// (Envoy never reuses a context id), and whether kvguard-control deferred it (200
/// `deferred`). Any other answer (ended, not found, refused), no call possible, or no
/// answer by the deadline ([`DEADLINE_MS`]: kvguard-control unreachable, the filter's
/// own judgement stands) is no deferral.
pub type Asked = (u32, bool);

/// The per-VM abort queue.
#[derive(Debug)]
pub struct AbortQueue {
    ready: VecDeque<Job>,
    backoff: Vec<Job>,
    in_flight: crate::Map<u32, Job>,
    max_pending: usize,
    rng: u64,
    asks: Vec<Asked>,
}

impl AbortQueue {
    /// An empty queue bounded at `max_pending`; `seed` drives the jitter.
    pub fn new(max_pending: usize, seed: u64) -> Self {
        AbortQueue {
            ready: VecDeque::new(),
            backoff: Vec::new(),
            in_flight: crate::Map::default(),
            max_pending,
            rng: seed | 1,
            asks: Vec::new(),
        }
    }

    /// The first answers of the aborts that asked, since the last call.
    pub fn take_asks(&mut self) -> Vec<Asked> {
        core::mem::take(&mut self.asks)
    }

    /// Reports the job's first outcome if it asked (once).
    fn settle(&mut self, job: &mut Job, deferred: bool) {
        if let Some((ctx, _)) = job.ask.take() {
            self.asks.push((ctx, deferred));
        }
    }

    /// Changes the bound (jobs already queued stay).
    pub fn set_max_pending(&mut self, max_pending: usize) {
        self.max_pending = max_pending;
    }

    /// Jobs queued, backing off or in flight.
    pub fn pending(&self) -> usize {
        self.ready.len() + self.backoff.len() + self.in_flight.len()
    }

    /// Calls in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether a pump now would send something.
    pub fn has_ready(&self, now_ms: u64) -> bool {
        self.in_flight.len() < MAX_IN_FLIGHT
            && (!self.ready.is_empty() || self.backoff.iter().any(|j| j.next_ms <= now_ms))
    }

    /// Queues a job; a full queue hands it back (`dropped`; boxed, off the hot path).
    pub fn push<M: Metrics + ?Sized>(&mut self, job: Job, metrics: &mut M) -> Result<(), Box<Job>> {
        if self.pending() >= self.max_pending {
            return Err(Box::new(job));
        }
        self.ready.push_back(job);
        metrics.add(Metric::PendingAborts, 1);
        Ok(())
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64*: jitter only, not security.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The delay before retry number `attempts` (1 = first retry): exponential, capped,
    /// with jitter in `[d/2, d]`.
    pub fn backoff_ms(&mut self, attempts: u32) -> u64 {
        let exp = attempts.saturating_sub(1).min(16);
        let d = BACKOFF_BASE_MS.saturating_mul(1 << exp).min(BACKOFF_MAX_MS);
        let half = d / 2;
        half + self.next_rand() % (d - half + 1)
    }

    /// Builds the signed call for a job sent at `now_ms`: `idle_ms` and `gone_ms` are
    /// measured at this attempt, not when the abort was decided.
    pub fn call<'c>(cfg: &'c Config, job: &Job, now_ms: u64, unix_secs: u64) -> (Call<'c>, Route) {
        let since = |t: Option<u64>| t.map(|t| now_ms.saturating_sub(t));
        let body = AbortRequest::new(&job.id, job.reason, job.age_ms, job.events)
            .with_durations(since(job.last_event_ms), since(job.gone_at_ms))
            .with_attempt(job.attempts.saturating_add(1))
            .with_recheck(job.ask.map(|(_, window)| u64::from(window)))
            .to_json();
        let sig = signature::sign(Domain::Abort, &cfg.key, unix_secs, &body);
        let mut headers: Vec<(&'static str, String)> = vec![
            (":method", "POST".to_owned()),
            (":path", cfg.abort_path.clone()),
            (":authority", cfg.control_authority.clone()),
            ("content-type", "application/json".to_owned()),
            (signature::SIGNATURE_HEADER, sig),
        ];
        let (cluster, route) = match (&cfg.target, job.target) {
            (Some(t), Some(addr)) => {
                headers.push((ORIGINAL_DST_HEADER, addr.to_string()));
                (t.cluster.as_str(), Route::Replica)
            }
            _ => (cfg.control_cluster.as_str(), Route::Fallback),
        };
        (
            Call {
                cluster,
                headers,
                body,
                timeout_ms: cfg.abort_timeout_ms,
            },
            route,
        )
    }

    /// This worker did not run for `stall_ms` (its process stopped, starved of CPU): every
    /// job's deadline moves on by it, since that silence was not kvguard-control's. A call
    /// whose answer the stall lost is then asked again rather than given up (a stall ask
    /// given up would cut a stream its client reads).
    pub fn stalled(&mut self, stall_ms: u64) {
        let jobs = self.ready.iter_mut().chain(self.backoff.iter_mut());
        for job in jobs.chain(self.in_flight.values_mut()) {
            job.deadline_ms = job.deadline_ms.saturating_add(stall_ms);
        }
    }

    /// Sends what is due, within the concurrency bound. Jobs past their deadline end
    /// as `failed`; calls the host refuses end as `dispatch_error` (unknown cluster) or
    /// are retried (any other refusal).
    pub fn pump<H: Host + Metrics + ?Sized>(
        &mut self,
        cfg: &Config,
        now_ms: u64,
        unix_secs: u64,
        host: &mut H,
        finished: &mut Vec<Finished>,
    ) {
        // The watchdog: a call whose answer never came (a host that lost the callback)
        // gives its slot back and is treated as timed out (retried within the deadline).
        let limit = cfg.abort_timeout_ms.saturating_add(WATCHDOG_SLACK_MS);
        let lost: Vec<u32> = self
            .in_flight
            .iter()
            .filter(|(_, j)| now_ms.saturating_sub(j.sent_ms) > limit)
            .map(|(t, _)| *t)
            .collect();
        for token in lost {
            if let Some(job) = self.in_flight.remove(&token) {
                host.add(Metric::AbortAnswersLost, 1);
                host.log(
                    Level::Warn,
                    &format!(
                        "abort request_id={} attempt={}: no answer {limit} ms after the call (the host lost it); its slot is freed and it counts as a timeout",
                        job.id, job.attempts
                    ),
                );
                self.retry_or_fail(cfg, job, None, now_ms, host, finished);
            }
        }
        // Due retries go first: they have waited longest.
        let mut i = 0;
        while i < self.backoff.len() {
            if self.backoff[i].next_ms <= now_ms {
                let job = self.backoff.swap_remove(i);
                self.ready.push_front(job);
            } else {
                i += 1;
            }
        }
        while self.in_flight.len() < MAX_IN_FLIGHT {
            let Some(mut job) = self.ready.pop_front() else {
                break;
            };
            // Past the deadline only a job already sent is given up: one that waited in a
            // stopped process (SIGSTOP, a stalled worker) is sent once when it resumes —
            // never sent, its orphan would have no end but the lease's.
            if job.attempts > 0 && now_ms > job.deadline_ms {
                self.finish(job, Outcome::Failed, None, host, finished);
                continue;
            }
            let (call, route) = Self::call(cfg, &job, now_ms, unix_secs);
            job.attempts += 1;
            job.sent_ms = now_ms;
            host.add(Metric::AbortAttempts, 1);
            if job.attempts == 1 {
                host.add(Metric::AbortRoutes(route), 1);
            }
            match host.dispatch(&call) {
                Ok(token) => {
                    if let Some(old) = self.in_flight.insert(token, job) {
                        // A token reused while in flight: the host's bug; keep the newer
                        // job and settle the older one as failed.
                        self.finish(old, Outcome::Failed, None, host, finished);
                    }
                }
                Err(DispatchError::BadArgument) => {
                    self.finish(job, Outcome::DispatchError, None, host, finished);
                }
                Err(DispatchError::Other) => {
                    self.retry_or_fail(cfg, job, None, now_ms, host, finished);
                }
            }
        }
    }

    fn retry_or_fail<M: Metrics + ?Sized>(
        &mut self,
        cfg: &Config,
        mut job: Job,
        status: Option<u16>,
        now_ms: u64,
        metrics: &mut M,
        finished: &mut Vec<Finished>,
    ) {
        // No answer is no verdict: an ask is retried as it was sent (its stream kept,
        // `recheck_ms` kept, so kvguard-control judges the same question again) until an
        // answer comes or the deadline passes; `abort_retries` bounds the other aborts.
        if job.ask.is_none() && job.attempts > cfg.abort_retries {
            self.finish(job, Outcome::Failed, status, metrics, finished);
            return;
        }
        // A stamped replica that did not answer (timeout, reset, or Envoy's 502/503/504:
        // no connection) is not asked again: the retries go to `control_cluster`, whose
        // replicas forward to their peers.
        if job.target.is_some() && matches!(status, None | Some(502..=504)) {
            job.target = None;
        }
        let next = now_ms.saturating_add(self.backoff_ms(job.attempts));
        if next > job.deadline_ms {
            self.finish(job, Outcome::Failed, status, metrics, finished);
            return;
        }
        job.next_ms = next;
        self.backoff.push(job);
    }

    fn finish<M: Metrics + ?Sized>(
        &mut self,
        mut job: Job,
        outcome: Outcome,
        status: Option<u16>,
        metrics: &mut M,
        finished: &mut Vec<Finished>,
    ) {
        self.settle(&mut job, outcome == Outcome::Deferred);
        metrics.add(Metric::PendingAborts, -1);
        metrics.add(Metric::Aborts(job.reason, outcome), 1);
        finished.push(Finished {
            job,
            outcome,
            status,
        });
    }

    /// An answer arrived for `token`: `status` is `None` for a timeout or reset.
    /// Unknown tokens are ignored.
    #[allow(clippy::too_many_arguments)]
    pub fn on_answer<M: Metrics + ?Sized>(
        &mut self,
        cfg: &Config,
        token: u32,
        status: Option<u16>,
        body: &[u8],
        now_ms: u64,
        metrics: &mut M,
        finished: &mut Vec<Finished>,
    ) {
        let Some(job) = self.in_flight.remove(&token) else {
            return;
        };
        let Some(code) = status else {
            self.retry_or_fail(cfg, job, None, now_ms, metrics, finished);
            return;
        };
        let outcome = match Disposition::of_status(code) {
            Disposition::Done => {
                if memchr::memmem::find(body, b"\"already_aborted\":true").is_some() {
                    Outcome::AlreadyAborted
                } else if job.ask.is_some() && contains(body, b"\"deferred\":true") {
                    Outcome::Deferred
                } else {
                    Outcome::Aborted
                }
            }
            Disposition::NotFound => Outcome::NotFound,
            Disposition::BadRequest => Outcome::BadRequest,
            Disposition::Unauthorized => Outcome::Unauthorized,
            Disposition::Unexpected => Outcome::Unexpected,
            // This very signed call reached kvguard-control before (a hop that retries
            // sent it twice) and that answer was lost: no verdict, so it is asked again,
            // signed anew, as after a timeout.
            Disposition::Replay | Disposition::Transient => {
                self.retry_or_fail(cfg, job, Some(code), now_ms, metrics, finished);
                return;
            }
        };
        self.finish(job, outcome, Some(code), metrics, finished);
    }

    /// Gives up every job (the VM stops before they could be delivered): each ends as
    /// `failed`, and the pending gauge comes down.
    pub fn abandon<M: Metrics + ?Sized>(&mut self, metrics: &mut M, finished: &mut Vec<Finished>) {
        let jobs: Vec<Job> = self
            .ready
            .drain(..)
            .chain(self.backoff.drain(..))
            .chain(self.in_flight.drain().map(|(_, j)| j))
            .collect();
        for job in jobs {
            self.finish(job, Outcome::Failed, None, metrics, finished);
        }
    }

    /// The earliest time a backing-off job is due, if any.
    #[cfg(test)]
    pub fn next_due_ms(&self) -> Option<u64> {
        self.backoff.iter().map(|j| j.next_ms).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, MockHost};
    use kvguard_contract::signature::verify;

    fn job(id: &str, now: u64) -> Job {
        Job::new(
            RequestId::try_new(id.as_bytes()).unwrap(),
            AbortReason::Stalled,
            5,
            6,
            None,
            now,
        )
    }

    #[test]
    fn signed_call_per_contract() {
        let cfg = config("");
        let (call, route) = AbortQueue::call(&cfg, &job("r1", 0), 0, 1_700_000_000);
        assert_eq!(route, Route::Fallback);
        assert_eq!(call.cluster, "kvguard");
        assert_eq!(call.timeout_ms, 1000);
        assert_eq!(
            call.body,
            br#"{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6,"attempt":1}"#
        );
        let h = |k: &str| {
            call.headers
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(h(":method").unwrap(), "POST");
        assert_eq!(h(":path").unwrap(), "/v1/abort");
        assert_eq!(h(":authority").unwrap(), "kvguard");
        let sig = h("x-kvguard-signature").unwrap();
        assert!(verify(
            Domain::Abort,
            std::slice::from_ref(&cfg.key),
            Some(sig.as_bytes()),
            &call.body,
            1_700_000_000
        )
        .is_ok());
        assert!(h(ORIGINAL_DST_HEADER).is_none());
    }

    #[test]
    fn each_attempt_is_signed_when_sent() {
        let cfg = config(r#","abort_retries":1"#);
        let mut q = AbortQueue::new(10, 1);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1_000, &mut h, &mut fin);
        let t = h.calls[0].0;
        q.on_answer(&cfg, t, Some(503), b"", 0, &mut h, &mut fin);
        let due = q.next_due_ms().unwrap();
        q.pump(&cfg, due, 1_007, &mut h, &mut fin);
        let sig = |i: usize| {
            h.calls[i]
                .2
                .iter()
                .find(|(k, _)| *k == "x-kvguard-signature")
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert!(sig(0).starts_with("t=1000,v1="));
        assert!(sig(1).starts_with("t=1007,v1="));
        // Each attempt is numbered in its body: a retry after a call that landed is never
        // taken for a replay of it.
        assert_ne!(h.calls[0].3, h.calls[1].3);
    }

    #[test]
    fn idle_and_gone_are_measured_at_each_attempt() {
        let cfg = config(r#","abort_retries":1"#);
        let mut q = AbortQueue::new(10, 1);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        // Last data event at 100, client gone at 400, decided at 400.
        q.push(job("g", 400).with_times(Some(100), Some(400)), &mut h)
            .unwrap();
        q.pump(&cfg, 450, 1, &mut h, &mut fin);
        let body = |h: &MockHost, i: usize| String::from_utf8(h.calls[i].3.clone()).unwrap();
        assert_eq!(
            body(&h, 0),
            r#"{"request_id":"g","reason":"stalled","age_ms":5,"tokens":6,"idle_ms":350,"gone_ms":50,"attempt":1}"#
        );
        let t = h.calls[0].0;
        q.on_answer(&cfg, t, Some(503), b"", 500, &mut h, &mut fin);
        let due = q.next_due_ms().unwrap();
        q.pump(&cfg, due, 1, &mut h, &mut fin);
        assert!(body(&h, 1).ends_with(&format!(
            r#""idle_ms":{},"gone_ms":{},"attempt":2}}"#,
            due - 100,
            due - 400
        )));
        // No event seen, client still connected: both absent.
        q.push(job("s", 0), &mut h).unwrap();
        q.pump(&cfg, 9_000, 1, &mut h, &mut fin);
        assert_eq!(
            body(&h, 2),
            r#"{"request_id":"s","reason":"stalled","age_ms":5,"tokens":6,"attempt":1}"#
        );
    }

    #[test]
    fn replica_route_needs_target_and_config() {
        let cfg = config(r#","control_target_cluster":"t","control_target_cidrs":["10.0.0.0/8"]"#);
        let mut j = job("r", 0);
        j.target = Some("10.1.2.3:9902".parse().unwrap());
        let (call, route) = AbortQueue::call(&cfg, &j, 0, 1);
        assert_eq!((call.cluster, route), ("t", Route::Replica));
        assert!(call
            .headers
            .contains(&(ORIGINAL_DST_HEADER, "10.1.2.3:9902".to_owned())));
        // Without a target-route config the stamp is not used.
        let plain = config("");
        let (call, route) = AbortQueue::call(&plain, &j, 0, 1);
        assert_eq!((call.cluster, route), ("kvguard", Route::Fallback));
    }

    /// Issue 27.7: an abort whose stamped replica is unreachable falls back to
    /// `control_cluster` on its retries instead of failing there.
    #[test]
    fn an_unreachable_replica_falls_back_to_control_cluster() {
        let cfg = config(r#","control_target_cluster":"t","control_target_cidrs":["10.0.0.0/8"]"#);
        // The cluster of the retry after the first call (to the replica) was answered so.
        let retried_to = |status: Option<u16>| {
            let mut q = AbortQueue::new(10, 7);
            let mut h = MockHost::default();
            let mut fin = Vec::new();
            let mut j = job("r", 0);
            j.target = Some("10.1.2.3:9902".parse().unwrap());
            q.push(j, &mut h).unwrap();
            q.pump(&cfg, 0, 1, &mut h, &mut fin);
            assert_eq!(h.calls[0].1, "t");
            q.on_answer(&cfg, h.calls[0].0, status, b"", 10, &mut h, &mut fin);
            q.pump(&cfg, 10_000, 1, &mut h, &mut fin);
            assert_eq!(h.calls.len(), 2, "{status:?}");
            let to_replica = h.calls[1].2.iter().any(|(k, _)| *k == ORIGINAL_DST_HEADER);
            assert_eq!(to_replica, h.calls[1].1 == "t");
            h.calls[1].1.clone()
        };
        for status in [None, Some(502), Some(503), Some(504)] {
            assert_eq!(retried_to(status), "kvguard", "{status:?}");
        }
        // Another transient answer came from the replica: it is asked again.
        assert_eq!(retried_to(Some(429)), "t");
    }

    /// The shipped configuration, and a queue that sent job `r` at time 0.
    fn one_job_sent() -> (Config, AbortQueue, MockHost, Vec<Finished>) {
        let cfg = config("");
        let mut q = AbortQueue::new(10, 7);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        (cfg, q, h, fin)
    }

    #[test]
    fn a_replayed_call_is_asked_again_signed_anew() {
        let (cfg, mut q, mut h, mut fin) = one_job_sent();
        // A hop sent it twice; the answer that got back is the second delivery's.
        q.on_answer(&cfg, h.calls[0].0, Some(409), b"", 10, &mut h, &mut fin);
        assert!(fin.is_empty(), "no verdict");
        q.pump(&cfg, 10_000, 1, &mut h, &mut fin);
        assert_eq!(h.calls.len(), 2, "asked again");
        let sig = |i: usize| {
            h.calls[i]
                .2
                .iter()
                .find(|(k, _)| *k == signature::SIGNATURE_HEADER)
                .map(|(_, v)| v.clone())
        };
        assert_ne!(sig(0), sig(1), "signed anew");
        q.on_answer(
            &cfg,
            h.calls[1].0,
            Some(200),
            br#"{"aborted":true}"#,
            20,
            &mut h,
            &mut fin,
        );
        assert_eq!(fin.len(), 1);
        assert_eq!(fin[0].outcome, Outcome::Aborted);
    }

    #[test]
    fn a_stall_of_the_worker_moves_every_deadline_on_by_it() {
        let (cfg, mut q, mut h, mut fin) = one_job_sent();
        q.push(job("waiting", 0), &mut h).unwrap();
        q.on_answer(&cfg, h.calls[0].0, None, b"", 1_000, &mut h, &mut fin);
        // The worker stopped 40 s: the retry, due meanwhile, goes when it resumes, and
        // the deadline is 30 s of the worker's running time.
        q.stalled(40_000);
        q.pump(&cfg, DEADLINE_MS + 40_000, 1, &mut h, &mut fin);
        assert!(fin.is_empty(), "{fin:?}");
        assert_eq!(h.calls.len(), 3, "retried, and the waiting one sent");
        let (t, at) = (h.calls[1].0, DEADLINE_MS + 40_001);
        q.on_answer(&cfg, t, None, b"", at, &mut h, &mut fin);
        assert_eq!(fin.len(), 1, "past the moved deadline: given up");
        assert_eq!(fin[0].outcome, Outcome::Failed);
    }

    #[test]
    fn a_retry_due_while_its_process_was_stopped_past_the_deadline_is_given_up() {
        let (cfg, mut q, mut h, mut fin) = one_job_sent();
        q.on_answer(&cfg, h.calls[0].0, None, b"", 1_000, &mut h, &mut fin);
        assert!(fin.is_empty(), "retried");
        // The worker ran again only past the deadline: sent once already, given up.
        q.pump(&cfg, DEADLINE_MS + 1, 1, &mut h, &mut fin);
        assert_eq!(h.calls.len(), 1, "not sent again");
        assert_eq!(fin[0].outcome, Outcome::Failed);
        assert_eq!(fin[0].job.attempts, 1);
    }

    #[test]
    fn bounded_queue_drops() {
        let cfg = config(r#","max_pending_aborts":2"#);
        let mut q = AbortQueue::new(cfg.max_pending_aborts, 7);
        let mut h = MockHost::default();
        assert!(q.push(job("a", 0), &mut h).is_ok());
        assert!(q.push(job("b", 0), &mut h).is_ok());
        assert!(q.push(job("c", 0), &mut h).is_err());
        assert_eq!(h.metric(Metric::PendingAborts), 2);
    }

    #[test]
    fn concurrency_is_bounded() {
        let cfg = config("");
        let mut q = AbortQueue::new(1000, 7);
        let mut h = MockHost::default();
        for i in 0..(MAX_IN_FLIGHT + 5) {
            q.push(job(&format!("r{i}"), 0), &mut h).unwrap();
        }
        let mut fin = Vec::new();
        let mut m = MockHost::default();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        assert_eq!(h.calls.len(), MAX_IN_FLIGHT);
        assert_eq!(q.in_flight(), MAX_IN_FLIGHT);
        assert!(!q.has_ready(0));
        // One answer frees one slot.
        let token = h.calls[0].0;
        q.on_answer(
            &cfg,
            token,
            Some(200),
            br#"{"aborted":true}"#,
            1,
            &mut m,
            &mut fin,
        );
        assert_eq!(fin.len(), 1);
        assert_eq!(fin[0].outcome, Outcome::Aborted);
        assert!(q.has_ready(1));
        q.pump(&cfg, 1, 1, &mut h, &mut fin);
        assert_eq!(h.calls.len(), MAX_IN_FLIGHT + 1);
    }

    #[test]
    fn answers_map_to_outcomes_without_retry() {
        let cfg = config("");
        for (status, body, outcome) in [
            (
                200,
                &br#"{"request_id":"r","found":true,"aborted":true}"#[..],
                Outcome::Aborted,
            ),
            (
                200,
                br#"{"request_id":"r","found":true,"already_aborted":true}"#,
                Outcome::AlreadyAborted,
            ),
            (
                404,
                br#"{"request_id":"r","found":false}"#,
                Outcome::NotFound,
            ),
            (400, b"", Outcome::BadRequest),
            (401, b"", Outcome::Unauthorized),
            (302, b"", Outcome::Unexpected),
        ] {
            let mut q = AbortQueue::new(10, 1);
            let mut h = MockHost::default();
            let mut fin = Vec::new();
            q.push(job("r", 0), &mut h).unwrap();
            q.pump(&cfg, 0, 1, &mut h, &mut fin);
            let token = *q.in_flight.keys().next().unwrap();
            q.on_answer(&cfg, token, Some(status), body, 10, &mut h, &mut fin);
            assert_eq!(fin.len(), 1, "{status}");
            assert_eq!(fin[0].outcome, outcome, "{status}");
            assert_eq!(q.pending(), 0);
            assert_eq!(h.metric(Metric::PendingAborts), 0);
            assert_eq!(h.metric(Metric::Aborts(AbortReason::Stalled, outcome)), 1);
        }
    }

    #[test]
    fn transient_answers_retry_with_backoff_then_fail() {
        let cfg = config(r#","abort_retries":2"#);
        let mut q = AbortQueue::new(10, 99);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        let mut now = 0;
        let mut sent = 0;
        for (status, _) in [(Some(503), 0), (None, 1), (Some(429), 2)] {
            q.pump(&cfg, now, 1, &mut h, &mut fin);
            sent += 1;
            assert_eq!(h.calls.len(), sent);
            let token = h.calls[sent - 1].0;
            q.on_answer(&cfg, token, status, b"", now, &mut h, &mut fin);
            if sent <= 2 {
                assert!(fin.is_empty());
                let due = q.next_due_ms().unwrap();
                let delay = due - now;
                let nominal = BACKOFF_BASE_MS << (sent - 1);
                assert!(
                    delay >= nominal / 2 && delay <= nominal,
                    "{delay} vs {nominal}"
                );
                // Not before it is due.
                q.pump(&cfg, due - 1, 1, &mut h, &mut fin);
                assert_eq!(h.calls.len(), sent);
                now = due;
            }
        }
        assert_eq!(fin.len(), 1);
        assert_eq!(fin[0].outcome, Outcome::Failed);
        assert_eq!(fin[0].status, Some(429));
        assert_eq!(fin[0].job.attempts, 3);
        assert_eq!(q.pending(), 0);
    }

    #[test]
    fn a_lost_answer_frees_its_slot_and_each_attempt_is_numbered() {
        let cfg = config(r#","abort_timeout_ms":1000,"abort_retries":3"#);
        let mut q = AbortQueue::new(10, 3);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        assert_eq!(q.in_flight(), 1);
        let attempt =
            |h: &MockHost, i: usize| AbortRequest::parse(&h.calls[i].3).unwrap().0.attempt;
        assert_eq!(attempt(&h, 0), Some(1));
        // The host never answers: within the slack the slot stays taken...
        q.pump(&cfg, 1000 + WATCHDOG_SLACK_MS, 1, &mut h, &mut fin);
        assert_eq!((q.in_flight(), h.calls.len()), (1, 1));
        // ...past it, the watchdog frees it; the retry is attempt 2, a new signature.
        q.pump(&cfg, 1001 + WATCHDOG_SLACK_MS, 1, &mut h, &mut fin);
        assert_eq!(h.metric(Metric::AbortAnswersLost), 1);
        assert_eq!(q.in_flight(), 0);
        let due = q.next_due_ms().unwrap();
        q.pump(&cfg, due, 1, &mut h, &mut fin);
        assert_eq!(attempt(&h, 1), Some(2));
        let sig = |h: &MockHost, i: usize| {
            h.calls[i]
                .2
                .iter()
                .find(|(k, _)| *k == signature::SIGNATURE_HEADER)
                .unwrap()
                .1
                .clone()
        };
        assert_ne!(sig(&h, 0), sig(&h, 1));
        // A late answer to the lost call changes nothing; the retry's answer settles it.
        q.on_answer(&cfg, h.calls[0].0, Some(200), b"", due, &mut h, &mut fin);
        assert!(fin.is_empty());
        q.on_answer(
            &cfg,
            h.calls[1].0,
            Some(200),
            br#"{"already_aborted":true}"#,
            due,
            &mut h,
            &mut fin,
        );
        assert_eq!(fin[0].outcome, Outcome::AlreadyAborted);
        assert_eq!(q.pending(), 0);
    }

    #[test]
    fn deadline_and_dispatch_errors() {
        let cfg = config(r#","abort_retries":10"#);
        let mut q = AbortQueue::new(10, 3);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        // Queued long ago (the process was stopped): sent once all the same, and given up
        // on its first answer that is not a verdict.
        q.pump(&cfg, DEADLINE_MS + 1, 1, &mut h, &mut fin);
        assert!(fin.is_empty());
        assert_eq!(h.calls.len(), 1, "sent once");
        q.on_answer(
            &cfg,
            h.calls[0].0,
            None,
            b"",
            DEADLINE_MS + 2,
            &mut h,
            &mut fin,
        );
        assert_eq!(fin[0].outcome, Outcome::Failed);
        assert_eq!(fin[0].job.attempts, 1);
        // Unknown cluster: permanent.
        let mut h = MockHost {
            refuse: Some(DispatchError::BadArgument),
            ..MockHost::default()
        };
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        assert_eq!(fin[1].outcome, Outcome::DispatchError);
        // Other refusals retry.
        let mut h = MockHost {
            refuse: Some(DispatchError::Other),
            ..MockHost::default()
        };
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        assert_eq!(fin.len(), 2);
        assert_eq!(q.pending(), 1);
        assert!(q.next_due_ms().is_some());
        // Retries stop at the deadline even with retries left.
        let mut now = 0;
        while fin.len() == 2 {
            now = q.next_due_ms().unwrap();
            q.pump(&cfg, now, 1, &mut h, &mut fin);
        }
        assert_eq!(fin[2].outcome, Outcome::Failed);
        assert!(now <= DEADLINE_MS);
        // Unknown tokens are ignored.
        q.on_answer(&cfg, 12345, Some(200), b"", 0, &mut h, &mut fin);
        assert_eq!(fin.len(), 3);
    }

    #[test]
    fn backoff_is_capped_and_jittered() {
        let mut q = AbortQueue::new(1, 42);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..50 {
            let d = q.backoff_ms(30);
            assert!((BACKOFF_MAX_MS / 2..=BACKOFF_MAX_MS).contains(&d));
            seen.insert(d);
        }
        assert!(seen.len() > 10, "jitter varies");
    }

    #[test]
    fn a_job_remembers_when_it_was_decided() {
        assert_eq!(job("r", 1_234).queued_ms(), 1_234);
        assert_eq!(job("r", 0).queued_ms(), 0);
    }

    #[test]
    fn a_new_bound_refuses_new_jobs_and_keeps_those_queued() {
        let mut q = AbortQueue::new(3, 1);
        let mut h = MockHost::default();
        q.push(job("a", 0), &mut h).unwrap();
        q.push(job("b", 0), &mut h).unwrap();
        q.set_max_pending(1);
        assert!(q.push(job("c", 0), &mut h).is_err());
        assert_eq!(q.pending(), 2);
        q.set_max_pending(5);
        assert!(q.push(job("c", 0), &mut h).is_ok());
        assert_eq!(q.pending(), 3);
    }

    #[test]
    fn a_retry_is_ready_only_once_due() {
        let cfg = config(r#","abort_retries":1"#);
        let mut q = AbortQueue::new(10, 1);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        q.push(job("r", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        q.on_answer(&cfg, h.calls[0].0, Some(503), b"", 0, &mut h, &mut fin);
        let due = q.next_due_ms().unwrap();
        assert!(!q.has_ready(due - 1));
        assert!(q.has_ready(due));
        assert!(q.has_ready(due + 1));
    }

    #[test]
    fn jitter_spans_the_whole_range_and_differs_between_seeds() {
        let draws = |seed: u64| {
            let mut q = AbortQueue::new(1, seed);
            (0..5_000).map(|_| q.backoff_ms(1)).collect::<Vec<u64>>()
        };
        let a = draws(1);
        // The first retry waits within [base/2, base], both ends included.
        assert!(a
            .iter()
            .all(|d| (BACKOFF_BASE_MS / 2..=BACKOFF_BASE_MS).contains(d)));
        assert_eq!(a.iter().min(), Some(&(BACKOFF_BASE_MS / 2)));
        assert_eq!(a.iter().max(), Some(&BACKOFF_BASE_MS));
        // Queues seeded differently (other VMs) do not retry in lockstep.
        assert_ne!(a, draws(2));
    }

    #[test]
    fn a_retry_may_be_due_at_the_deadline_but_not_after() {
        let cfg = config(r#","abort_retries":3"#);
        // The same seed draws the same jitter: a twin queue tells the first retry's delay.
        let delay = AbortQueue::new(10, 3).backoff_ms(1);
        for late in [0, 1] {
            let mut q = AbortQueue::new(10, 3);
            let mut h = MockHost::default();
            let mut fin = Vec::new();
            q.push(job("r", 0), &mut h).unwrap();
            q.pump(&cfg, 0, 1, &mut h, &mut fin);
            let answered = DEADLINE_MS - delay + late;
            q.on_answer(
                &cfg,
                h.calls[0].0,
                Some(503),
                b"",
                answered,
                &mut h,
                &mut fin,
            );
            if late == 0 {
                // Due at the deadline's last moment: kept, and sent then.
                assert!(fin.is_empty());
                assert_eq!(q.next_due_ms(), Some(DEADLINE_MS));
                q.pump(&cfg, DEADLINE_MS, 1, &mut h, &mut fin);
                assert_eq!(h.calls.len(), 2);
                assert!(fin.is_empty());
                assert_eq!(q.in_flight(), 1);
            } else {
                // It would be due past the deadline: given up at once, with the last status.
                assert_eq!(fin.len(), 1);
                assert_eq!(fin[0].outcome, Outcome::Failed);
                assert_eq!(fin[0].status, Some(503));
                assert_eq!(q.pending(), 0);
            }
        }
    }

    #[test]
    fn abandoning_fails_every_job_wherever_it_is() {
        let cfg = config(r#","abort_retries":3"#);
        let mut q = AbortQueue::new(10, 1);
        let mut h = MockHost::default();
        let mut fin = Vec::new();
        // "a" in flight, "b" backing off, "c" queued.
        q.push(job("a", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        h.refuse = Some(DispatchError::Other);
        q.push(job("b", 0), &mut h).unwrap();
        q.pump(&cfg, 0, 1, &mut h, &mut fin);
        q.push(job("c", 0), &mut h).unwrap();
        assert_eq!((q.pending(), q.in_flight()), (3, 1));
        assert!(fin.is_empty());
        q.abandon(&mut h, &mut fin);
        let mut ids: Vec<String> = fin.iter().map(|f| f.job.id.to_string()).collect();
        ids.sort();
        assert_eq!(ids, ["a", "b", "c"]);
        assert!(fin.iter().all(|f| f.outcome == Outcome::Failed));
        assert_eq!(q.pending(), 0);
        assert_eq!(h.metric(Metric::PendingAborts), 0);
        assert_eq!(
            h.metric(Metric::Aborts(AbortReason::Stalled, Outcome::Failed)),
            3
        );
    }
}
