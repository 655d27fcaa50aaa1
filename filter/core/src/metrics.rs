//! Metric definitions (contract §7). Labelled families use Istio's tag style
//! (`<name>_<label>=.=<value>;.;`) so Envoy's `stats_tags` can turn them into Prometheus
//! labels; see `filter/README.md` for the `stats_tags` block.

use kvguard_contract::AbortReason;

/// Prefix of every filter metric.
pub const PREFIX: &str = "kvguard_filter_";

/// Counter or gauge. Gauges are shared by all worker VMs: move them by increments only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down (by `increment(±n)`, never `record`).
    Gauge,
    /// Envoy histogram: each `record` is one observation (Envoy computes the buckets).
    Histogram,
}

/// Why a matching request was not tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untracked {
    /// No `x-request-id` header.
    NoRequestId,
    /// The header is not a valid id (contract §1).
    BadRequestId,
}

impl Untracked {
    const ALL: [Untracked; 2] = [Untracked::NoRequestId, Untracked::BadRequestId];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Untracked::NoRequestId => "no_request_id",
            Untracked::BadRequestId => "bad_request_id",
        }
    }
}

/// How an abort ended (label `outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 200, it was in flight and is now ended.
    Aborted,
    /// 200, it had ended earlier.
    AlreadyAborted,
    /// 404, not in flight (tombstoned).
    NotFound,
    /// 400.
    BadRequest,
    /// 401.
    Unauthorized,
    /// Any other status.
    Unexpected,
    /// Transient answers until retries or the deadline ran out.
    Failed,
    /// The abort queue was full.
    Dropped,
    /// The host refused the call (e.g. unknown cluster).
    DispatchError,
    /// 200 `deferred`: kvguard-control found the stalled stream producing at the engine
    /// and its reader draining; the stream is kept and asked about again.
    Deferred,
}

impl Outcome {
    /// Every outcome.
    pub const ALL: [Outcome; 10] = [
        Outcome::Aborted,
        Outcome::AlreadyAborted,
        Outcome::NotFound,
        Outcome::BadRequest,
        Outcome::Unauthorized,
        Outcome::Unexpected,
        Outcome::Failed,
        Outcome::Dropped,
        Outcome::DispatchError,
        Outcome::Deferred,
    ];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Aborted => "aborted",
            Outcome::AlreadyAborted => "already_aborted",
            Outcome::NotFound => "not_found",
            Outcome::BadRequest => "bad_request",
            Outcome::Unauthorized => "unauthorized",
            Outcome::Unexpected => "unexpected",
            Outcome::Failed => "failed",
            Outcome::Dropped => "dropped",
            Outcome::DispatchError => "dispatch_error",
            Outcome::Deferred => "deferred",
        }
    }
    const fn index(self) -> usize {
        self as usize
    }
}

/// Where an abort was sent (label `route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// To the stamped replica through `control_target_cluster`.
    Replica,
    /// To `control_cluster`.
    Fallback,
}

impl Route {
    const ALL: [Route; 2] = [Route::Replica, Route::Fallback];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Route::Replica => "replica",
            Route::Fallback => "fallback",
        }
    }
}

/// Why an `x-kvguard-control` stamp was not used (label `cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampRejected {
    /// Not `<ip>:<port>;t=..;v2=..`.
    Malformed,
    /// `sig=` in place of `v2=`: its kvguard-control predates the stamp's domain prefix.
    Outdated,
    /// The signature does not verify for this request id.
    Mismatch,
    /// The address is outside `control_target_cidrs`.
    OutsideCidrs,
    /// The address names a port outside `control_target_ports`.
    PortNotAllowed,
}

impl StampRejected {
    const ALL: [StampRejected; 5] = [
        StampRejected::Malformed,
        StampRejected::Outdated,
        StampRejected::Mismatch,
        StampRejected::OutsideCidrs,
        StampRejected::PortNotAllowed,
    ];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            StampRejected::Malformed => "malformed",
            StampRejected::Outdated => "outdated",
            StampRejected::Mismatch => "mismatch",
            StampRejected::OutsideCidrs => "outside_cidrs",
            StampRejected::PortNotAllowed => "port_not_allowed",
        }
    }
}

/// Something unusual in a response body (label `kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anomaly {
    /// An event over `max_event_bytes` (skipped, still progress).
    OversizedEvent,
    /// An event whose JSON could not be followed.
    MalformedJson,
    /// A compressed (content-encoding) stream: end of stream only.
    Compressed,
    /// A body that is neither SSE nor NDJSON: end of stream only.
    OpaqueBody,
}

impl Anomaly {
    const ALL: [Anomaly; 4] = [
        Anomaly::OversizedEvent,
        Anomaly::MalformedJson,
        Anomaly::Compressed,
        Anomaly::OpaqueBody,
    ];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Anomaly::OversizedEvent => "oversized_event",
            Anomaly::MalformedJson => "malformed_json",
            Anomaly::Compressed => "compressed",
            Anomaly::OpaqueBody => "opaque_body",
        }
    }
}

/// How a tracked request ended (label `outcome` of the per-request histograms): the
/// family of its `kvguard.outcome` filter state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It completed (the body said so, or the upstream ended it).
    Completed,
    /// An abort was decided for it (enforce mode).
    Aborted,
    /// Observe mode flagged it (it may still have completed).
    Observed,
}

impl Ended {
    /// Every value.
    pub const ALL: [Ended; 3] = [Ended::Completed, Ended::Aborted, Ended::Observed];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Ended::Completed => "completed",
            Ended::Aborted => "aborted",
            Ended::Observed => "observed",
        }
    }
}

/// Every metric the filter defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Requests tracked.
    RequestsTracked,
    /// Matching requests not tracked, by cause.
    RequestsUntracked(Untracked),
    /// Tracked requests that completed.
    RequestsCompleted,
    /// Tracked requests in flight (gauge).
    ActiveRequests,
    /// Abort decisions that ended, by reason and outcome.
    Aborts(AbortReason, Outcome),
    /// Aborts queued, in flight or backing off (gauge).
    PendingAborts,
    /// Abort calls sent (first tries and retries).
    AbortAttempts,
    /// Aborts sent per route (counted once per abort).
    AbortRoutes(Route),
    /// Stamps not used, by cause.
    StampRejected(StampRejected),
    /// Body anomalies, by kind.
    ParseAnomalies(Anomaly),
    /// Observe mode: what would have been aborted, by reason.
    WouldAbort(AbortReason),
    /// Streams the tick closed.
    StreamsClosed,
    /// Linear memory of the VMs (gauge, summed over workers).
    VmMemoryBytes,
    /// Host calls that failed unexpectedly (the filter failed open).
    HostErrors,
    /// Stall closes held one more idle window by the mass-stall valve.
    StallHolds,
    /// Host ticks that came more than two periods late: this worker did not run meanwhile,
    /// and idleness closes waited as long (see `Engine::on_host_tick`).
    WorkerStalls,
    // ---- Per-request histograms (one observation each, at the request's end), labelled
    // by how the request ended: the label picks which histogram is recorded, so it adds no
    // host call ----
    /// Time to the first data event, ms.
    FirstTokenMs(Ended),
    /// The largest gap between two data events of one stream, ms.
    MaxTokenGapMs(Ended),
    /// Request start to its end (the access-log callback), ms.
    StreamDurationMs(Ended),
    /// Abort decided to its final answer (retries included), ms, by the abort's outcome.
    AbortRoundTripMs(Outcome),
    /// Out-of-band liveness-lease renewals, by result (`sent`, `accepted`, `failed`).
    LeaseRenewals(LeaseResult),
    /// In-band liveness-lease renewals (over the upstream clusters), by result.
    LeaseDataRenewals(LeaseResult),
    /// Abort calls whose answer never came (the watchdog freed their slot).
    AbortAnswersLost,
}

// ---- Liveness leases (contract §8) and lost abort answers -------------------------------------------------------

/// What became of a lease renewal (label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseResult {
    /// Dispatched.
    Sent,
    /// Answered 200.
    Accepted,
    /// Refused by the host, timed out, or answered anything but 200.
    Failed,
}

impl LeaseResult {
    const ALL: [LeaseResult; 3] = [
        LeaseResult::Sent,
        LeaseResult::Accepted,
        LeaseResult::Failed,
    ];
    /// Label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            LeaseResult::Sent => "sent",
            LeaseResult::Accepted => "accepted",
            LeaseResult::Failed => "failed",
        }
    }
}

// ---- end of liveness leases -------------------------------------------------------------

const R: usize = AbortReason::ALL.len();
const O: usize = Outcome::ALL.len();
const BASE_UNTRACKED: usize = 1;
const BASE_COMPLETED: usize = BASE_UNTRACKED + Untracked::ALL.len();
const BASE_ACTIVE: usize = BASE_COMPLETED + 1;
const BASE_ABORTS: usize = BASE_ACTIVE + 1;
const BASE_PENDING: usize = BASE_ABORTS + R * O;
const BASE_ATTEMPTS: usize = BASE_PENDING + 1;
const BASE_ROUTES: usize = BASE_ATTEMPTS + 1;
const BASE_STAMP: usize = BASE_ROUTES + Route::ALL.len();
const BASE_ANOMALY: usize = BASE_STAMP + StampRejected::ALL.len();
const BASE_WOULD: usize = BASE_ANOMALY + Anomaly::ALL.len();
const BASE_CLOSED: usize = BASE_WOULD + R;
const BASE_MEMORY: usize = BASE_CLOSED + 1;
const BASE_HOST: usize = BASE_MEMORY + 1;
const BASE_HOLDS: usize = BASE_HOST + 1;
const BASE_WORKER_STALLS: usize = BASE_HOLDS + 1;
const BASE_HIST: usize = BASE_WORKER_STALLS + 1;
const E: usize = Ended::ALL.len();
const BASE_ROUND_TRIP: usize = BASE_HIST + 3 * E;
const BASE_LEASE: usize = BASE_ROUND_TRIP + O;
const BASE_LEASE_DATA: usize = BASE_LEASE + LeaseResult::ALL.len();
const BASE_LOST: usize = BASE_LEASE_DATA + LeaseResult::ALL.len();

impl Metric {
    /// How many distinct metrics exist (for id caches).
    pub const COUNT: usize = BASE_LOST + 1;

    /// A dense index in `0..COUNT`.
    pub fn index(self) -> usize {
        match self {
            Metric::RequestsTracked => 0,
            Metric::RequestsUntracked(c) => BASE_UNTRACKED + c as usize,
            Metric::RequestsCompleted => BASE_COMPLETED,
            Metric::ActiveRequests => BASE_ACTIVE,
            Metric::Aborts(r, o) => BASE_ABORTS + r.index() * O + o.index(),
            Metric::PendingAborts => BASE_PENDING,
            Metric::AbortAttempts => BASE_ATTEMPTS,
            Metric::AbortRoutes(r) => BASE_ROUTES + r as usize,
            Metric::StampRejected(c) => BASE_STAMP + c as usize,
            Metric::ParseAnomalies(a) => BASE_ANOMALY + a as usize,
            Metric::WouldAbort(r) => BASE_WOULD + r.index(),
            Metric::StreamsClosed => BASE_CLOSED,
            Metric::VmMemoryBytes => BASE_MEMORY,
            Metric::HostErrors => BASE_HOST,
            Metric::StallHolds => BASE_HOLDS,
            Metric::WorkerStalls => BASE_WORKER_STALLS,
            Metric::FirstTokenMs(e) => BASE_HIST + e as usize,
            Metric::MaxTokenGapMs(e) => BASE_HIST + E + e as usize,
            Metric::StreamDurationMs(e) => BASE_HIST + 2 * E + e as usize,
            Metric::AbortRoundTripMs(o) => BASE_ROUND_TRIP + o.index(),
            Metric::LeaseRenewals(r) => BASE_LEASE + r as usize,
            Metric::LeaseDataRenewals(r) => BASE_LEASE_DATA + r as usize,
            Metric::AbortAnswersLost => BASE_LOST,
        }
    }

    /// Counter or gauge.
    pub fn kind(self) -> Kind {
        match self {
            Metric::ActiveRequests | Metric::PendingAborts | Metric::VmMemoryBytes => Kind::Gauge,
            Metric::FirstTokenMs(_)
            | Metric::MaxTokenGapMs(_)
            | Metric::StreamDurationMs(_)
            | Metric::AbortRoundTripMs(_) => Kind::Histogram,
            _ => Kind::Counter,
        }
    }

    /// The full stat name, e.g.
    /// `kvguard_filter_aborts_total_reason=.=stalled;.;_outcome=.=aborted;.;`.
    pub fn name(self) -> String {
        fn tag(name: &str, label: &str, value: &str) -> String {
            format!("{PREFIX}{name}_{label}=.={value};.;")
        }
        match self {
            Metric::RequestsTracked => format!("{PREFIX}requests_tracked_total"),
            Metric::RequestsUntracked(c) => tag("requests_untracked_total", "cause", c.as_str()),
            Metric::RequestsCompleted => format!("{PREFIX}requests_completed_total"),
            Metric::ActiveRequests => format!("{PREFIX}active_requests"),
            Metric::Aborts(r, o) => format!(
                "{PREFIX}aborts_total_reason=.={};.;_outcome=.={};.;",
                r.as_str(),
                o.as_str()
            ),
            Metric::PendingAborts => format!("{PREFIX}pending_aborts"),
            Metric::AbortAttempts => format!("{PREFIX}abort_attempts_total"),
            Metric::AbortRoutes(r) => tag("abort_routes_total", "route", r.as_str()),
            Metric::StampRejected(c) => tag("stamp_rejected_total", "cause", c.as_str()),
            Metric::ParseAnomalies(a) => tag("parse_anomalies_total", "kind", a.as_str()),
            Metric::WouldAbort(r) => tag("would_abort_total", "reason", r.as_str()),
            Metric::StreamsClosed => format!("{PREFIX}streams_closed_total"),
            Metric::VmMemoryBytes => format!("{PREFIX}vm_memory_bytes"),
            Metric::HostErrors => format!("{PREFIX}host_errors_total"),
            Metric::StallHolds => format!("{PREFIX}stall_holds_total"),
            Metric::WorkerStalls => format!("{PREFIX}worker_stalls_total"),
            Metric::FirstTokenMs(e) => tag("first_token_ms", "outcome", e.as_str()),
            Metric::MaxTokenGapMs(e) => tag("max_token_gap_ms", "outcome", e.as_str()),
            Metric::StreamDurationMs(e) => tag("stream_duration_ms", "outcome", e.as_str()),
            Metric::AbortRoundTripMs(o) => tag("abort_round_trip_ms", "outcome", o.as_str()),
            Metric::LeaseRenewals(r) => tag("lease_renewals_total", "result", r.as_str()),
            Metric::LeaseDataRenewals(r) => tag("lease_data_renewals_total", "result", r.as_str()),
            Metric::AbortAnswersLost => format!("{PREFIX}abort_answers_lost_total"),
        }
    }

    /// Every metric, in index order.
    pub fn all() -> Vec<Metric> {
        let mut v = vec![Metric::RequestsTracked];
        v.extend(Untracked::ALL.map(Metric::RequestsUntracked));
        v.push(Metric::RequestsCompleted);
        v.push(Metric::ActiveRequests);
        for r in AbortReason::ALL {
            for o in Outcome::ALL {
                v.push(Metric::Aborts(r, o));
            }
        }
        v.push(Metric::PendingAborts);
        v.push(Metric::AbortAttempts);
        v.extend(Route::ALL.map(Metric::AbortRoutes));
        v.extend(StampRejected::ALL.map(Metric::StampRejected));
        v.extend(Anomaly::ALL.map(Metric::ParseAnomalies));
        v.extend(AbortReason::ALL.map(Metric::WouldAbort));
        v.push(Metric::StreamsClosed);
        v.push(Metric::VmMemoryBytes);
        v.push(Metric::HostErrors);
        v.push(Metric::StallHolds);
        v.push(Metric::WorkerStalls);
        v.extend(Ended::ALL.map(Metric::FirstTokenMs));
        v.extend(Ended::ALL.map(Metric::MaxTokenGapMs));
        v.extend(Ended::ALL.map(Metric::StreamDurationMs));
        v.extend(Outcome::ALL.map(Metric::AbortRoundTripMs));
        v.extend(LeaseResult::ALL.map(Metric::LeaseRenewals));
        v.extend(LeaseResult::ALL.map(Metric::LeaseDataRenewals));
        v.push(Metric::AbortAnswersLost);
        v
    }
}

/// Where metric updates go.
pub trait Metrics {
    /// Adds `delta` (negative only for gauges).
    fn add(&mut self, m: Metric, delta: i64);
    /// Records one observation of a [`Kind::Histogram`] metric.
    fn record(&mut self, m: Metric, value: u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_are_dense_and_names_unique() {
        let all = Metric::all();
        assert_eq!(all.len(), Metric::COUNT);
        for (i, m) in all.iter().enumerate() {
            assert_eq!(m.index(), i, "{m:?}");
            assert!(m.name().starts_with(PREFIX));
        }
        let mut names: Vec<String> = all.iter().map(|m| m.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Metric::COUNT);
    }

    #[test]
    fn tag_style_names() {
        assert_eq!(
            Metric::Aborts(AbortReason::Stalled, Outcome::Aborted).name(),
            "kvguard_filter_aborts_total_reason=.=stalled;.;_outcome=.=aborted;.;"
        );
        assert_eq!(
            Metric::WouldAbort(AbortReason::MaxAge).name(),
            "kvguard_filter_would_abort_total_reason=.=max_age;.;"
        );
        assert_eq!(Metric::ActiveRequests.kind(), Kind::Gauge);
        assert_eq!(Metric::StreamsClosed.kind(), Kind::Counter);
        assert_eq!(
            Metric::FirstTokenMs(Ended::Completed).kind(),
            Kind::Histogram
        );
        assert_eq!(
            Metric::AbortRoundTripMs(Outcome::Aborted).name(),
            "kvguard_filter_abort_round_trip_ms_outcome=.=aborted;.;"
        );
        assert_eq!(
            Metric::StreamDurationMs(Ended::Observed).name(),
            "kvguard_filter_stream_duration_ms_outcome=.=observed;.;"
        );
    }
}
